"""Will a config fit a TPU slice or a GPU host? The plan, by stages, each its own module:
the targets and their compile-only devices (`targets`), the compiler ahead of time
(`compiler`), the run's programs (`programs`), the slot search (`search`), the decode
roofline (`roofline`), the verdict (`verdict`) and the command line (`__main__`:
`python -m ada_jax.plan`). Nothing is imported here, so that the command keeps JAX off
the platform it compiles for.
"""
