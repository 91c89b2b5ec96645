"""How an evaluation (or a prompt selection) generates: the chunked samplers, built once per
run and passed to every call so that repeated evaluations compile once (`EvalSamplers`), the
`benchmarks.Policy` over a sampler (`sampler_policy`), and `evaluate`, a model's Avg@k
through `benchmarks.evaluate_policy` (`eval.evaluator.Evaluator.run`'s).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax

from ada_jax.eval.benchmarks import (
  Benchmark,
  EvalConfig,
  Policy,
  ResultCache,
  Scorer,
  evaluate_policy,
)
from ada_jax.models.decoder import ModelConfig, Params
from ada_jax.models.tokenizer import Tokenizer
from ada_jax.rollout import sampler


def make_sampler(
  model_config: ModelConfig,
  tokenizer: Tokenizer,
  config: EvalConfig,
  *,
  rule: sampler.SamplingRule | None = None,
  rows_per_problem: int | None = None,
  mesh: jax.sharding.Mesh | None = None,
) -> sampler.Sampler:
  """The chunked sampler of an evaluation (or a prompt selection): its `sampler` group,
  `rows_per_problem` rows per problem (default `config.k`) sharing one prefill
  (`rollout.sampler.prompts_per_chunk`).

  Args:
    model_config: the architecture.
    tokenizer: stop ids and pad id.
    config: its `sampler` group: budget, chunking, buckets and (unless `rule` is given)
      the sampling rule.
    rule: overrides `config`'s sampling rule (greedy accuracy).
    rows_per_problem: rows drawn per problem (1 for greedy).
    mesh: sampler mesh (rows over the data axes), or None for one device.

  Returns:
    A `sampler.Sampler`; it compiles on its first call, so build it once per run and pass
    it on (`EvalSamplers`).
  """
  rows = config.k if rows_per_problem is None else rows_per_problem
  return sampler.Sampler.from_spec(
    model_config,
    config.sampler,
    stop_ids=tokenizer.eos_ids,
    rows_per_prompt=rows,
    pad_id=tokenizer.pad_id,
    mesh=mesh,
    rule=rule,
  )


@dataclasses.dataclass(frozen=True)
class EvalSamplers:
  """The samplers an evaluation generates with, built once per run (`make`) and passed to
  every `evaluate` call, so that periodic evaluation compiles only on its first call.

  Attributes:
    sampled: k rows per problem under the config's sampling rule (Avg@k, pass@j).
    greedy: one greedy row per problem, or None when `config.greedy` is off.
  """

  sampled: sampler.Sampler
  greedy: sampler.Sampler | None = None

  @classmethod
  def make(
    cls,
    model_config: ModelConfig,
    tokenizer: Tokenizer,
    config: EvalConfig,
    mesh: jax.sharding.Mesh | None = None,
  ) -> EvalSamplers:
    """The samplers `config` asks for (see `make_sampler`): `sampled` with the config's
    rule and k rows per problem, `greedy` at temperature 0 with one."""
    kinds = {"sampled": (None, None)}
    if config.greedy:
      kinds["greedy"] = (sampler.SamplingRule(temperature=0.0), 1)
    return cls(
      **{
        kind: make_sampler(
          model_config, tokenizer, config, rule=rule, rows_per_problem=rows, mesh=mesh
        )
        for kind, (rule, rows) in kinds.items()
      }
    )


def sampler_policy(sampler_: sampler.Sampler, params: Params, tokenizer: Tokenizer) -> Policy:
  """A `Policy` generating with `sampler_` and decoding each response up to its length
  (the stop token included, dropped by the decoder as a special token). It decodes from
  one rollout copy of `params` (`Sampler.rollout_params`), made here for all its calls."""
  params = sampler_.rollout_params(params)

  def policy(prompt_tokens, row_prompt, rng):
    out, _ = sampler_.generate(params, prompt_tokens, row_prompt, rng)
    rows = [t[:n] for t, n in zip(out["tokens"], out["lengths"], strict=True)]
    return tokenizer.decode_many(rows), out["lengths"]

  return policy


def evaluate(
  params: Params,
  samplers: EvalSamplers,
  tokenizer: Tokenizer,
  benchmarks: Sequence[Benchmark],
  config: EvalConfig,
  rng: jax.Array,
  scorers: Mapping[str, Scorer],
  *,
  cache: ResultCache | None = None,
  model_tag: str = "",
  progress: bool = False,
  records: dict[str, list[dict]] | None = None,
) -> dict[str, dict[str, float]]:
  """Avg@k (and pass@j, greedy) of a model; the training loop's periodic-eval hook.

  No file I/O unless a cache is given.

  Args:
    params: the policy's parameters (placed as the samplers' mesh expects, if any).
    samplers: `EvalSamplers.make(model_config, tokenizer, config, mesh)`, built once.
    tokenizer: decoding.
    benchmarks: from `benchmarks.load_benchmark`.
    config: settings.
    rng: PRNG key (e.g. `fold_in(eval_key, step)`).
    scorers: judge name -> reward function (`Verifier.score` of a pool of that judge).
    cache, model_tag, progress, records: see `evaluate_policy`.

  Returns:
    `{benchmark: metrics, ..., 'average': weighted metrics}`; `flat_metrics` flattens it.

  `eval.evaluator.Evaluator` makes the samplers and benchmarks once and adds pools, the cache
  and the reports.
  """
  params = samplers.sampled.rollout_params(params)  # one copy for both policies
  policy = sampler_policy(samplers.sampled, params, tokenizer)
  greedy = None
  if config.greedy:
    if samplers.greedy is None:
      raise ValueError("config.greedy is set but samplers.greedy is None (EvalSamplers.make)")
    greedy = sampler_policy(samplers.greedy, params, tokenizer)
  kw = dict(cache=cache, model_tag=model_tag, progress=progress, records=records)
  return evaluate_policy(policy, benchmarks, config, rng, scorers, greedy_policy=greedy, **kw)
