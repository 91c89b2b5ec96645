"""ada_jax: Reinforce-Ada (arXiv 2510.04996) adaptive sampling for LLM RL post-training, in JAX."""

__version__ = "0.1.0"
