"""Bernoulli-prompt simulator: sampling cost vs learning signal of the controller, no model.

Illustrates the paper's argument (arXiv 2510.04996, §3: GRPO's groups carry no signal on
prompts that are too hard or too easy; adaptive sampling with global normalization is the
fix) with the REAL controller `ada_jax.rl.controller.run_step` under `rounds`, but with a
Bernoulli verifier: prompt i has a fixed pass rate p_i and each response is correct with
probability p_i, independently. Nothing here is a separate implementation of GRPO, DAPO
or Reinforce-Ada: `simulate` only feeds `run_step` prompts and Bernoulli rewards
(`controller.DrawEngine`) and totals its `StepStats`.

Learning signal: a prompt has signal when its training group holds a non-zero advantage
(for 0/1 rewards: its kept group, or for the global baseline its pool, is mixed).

Closed forms the simulator is checked against (tests/test_simulate.py):

* GRPO with n responses: P(signal) = 1 - E[p^n + (1-p)^n].
* Reinforce-Ada-pos with k_pos = 1, M responses per round and at most R rounds: a prompt
  stays active while all its responses are wrong, so it draws
  M * sum_{j<R} (1-p)^{Mj} responses in expectation and has signal with probability
  1 - p^M - (1-p)^{MR} (all M of round one correct, or all MR responses wrong).

Measured pass rates: every method's `StepStats.first_round_pass_rate` (each prompt's
first-round samples, drawn before any exit decision) should match the step's true mean
pass rate within sampling error; the mean over every response drawn (`pool_pass_rate`)
reads high for pos and balance, which stop sampling a prompt after successes. `simulate`
reports both against the truth (tests/test_simulate.py checks it for every method).

Each prompt carries toy features (`toy_features`), the "hidden states" Est's learned
pass-rate head reads: it can then be compared with the EMA on first visits. Units: pass
rates are probabilities in [0, 1]; "samples" are responses drawn; fractions are of the
step's B prompts. Randomness: numpy Generators seeded from the `seed` arguments.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ada_jax.rl import controller, rules
from ada_jax.rl.pools import StepResult
from ada_jax.rl.rules import EST_PAPER, AdaConfig, DapoConfig, EstConfig, SeqConfig

__all__ = [
  "PASS_RATE_MIX",
  "SimResult",
  "closed_form_checks",
  "grpo_n_for_signal",
  "grpo_signal",
  "markdown_table",
  "method_table",
  "plot_cost_vs_signal",
  "pos_closed_form",
  "sample_pass_rates",
  "simulate",
  "toy_features",
  "trace_step",
]

# (weight, a, b) of the Beta mixture the pass rates come from: many hard prompts (mean
# ~0.06, a long tail at ~0), a band of medium ones, and easy ones near 1.
PASS_RATE_MIX: tuple[tuple[float, float, float], ...] = (
  (0.45, 0.4, 6.0),
  (0.25, 2.0, 2.0),
  (0.30, 6.0, 0.5),
)

Mix = Sequence[tuple[float, float, float]]


def _check_int(name: str, value: Any, low: int) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
    raise ValueError(f"{name}={value!r}: must be an int >= {low}")


def _check_pass_rates(pass_rates: Any, name: str = "pass_rates") -> np.ndarray:
  p = np.asarray(pass_rates, np.float64)
  if p.ndim != 1 or p.size == 0:
    raise ValueError(f"{name}: need a non-empty 1-D array, got shape {p.shape}")
  if not np.all((p >= 0) & (p <= 1)):
    raise ValueError(f"{name}: every pass rate must lie in [0, 1]")
  return p


def sample_pass_rates(rng: np.random.Generator, size: int, mix: Mix = PASS_RATE_MIX) -> np.ndarray:
  """Draws pass rates from a mixture of Beta distributions.

  Args:
    rng: the Generator consumed (one component choice and one Beta draw per prompt).
    size: number of prompts, >= 0.
    mix: (weight, a, b) per component; weights > 0 (normalised here), a, b > 0.

  Returns:
    float64[size] pass rates in [0, 1].

  Raises:
    ValueError: a negative `size` or a bad `mix` component.
  """
  _check_int("size", size, 0)
  if not mix or any(w <= 0 or a <= 0 or b <= 0 for w, a, b in mix):
    raise ValueError(f"mix={mix!r}: need (weight, a, b) components, all > 0")
  weights = np.array([w for w, _, _ in mix])
  comp = rng.choice(len(mix), size=size, p=weights / weights.sum())
  a = np.array([x for _, x, _ in mix])[comp]
  b = np.array([y for _, _, y in mix])[comp]
  return rng.beta(a, b)


def toy_features(
  pass_rates: np.ndarray, rng: np.random.Generator, noise: float = 1.0, dims: int = 8
) -> np.ndarray:
  """Per-prompt features correlated with the pass rate: float32[P, dims], column 0 =
  logit(clip(p, 0.01, 0.99)) + noise·N(0, 1), the other columns N(0, 1) (uninformative).
  Raises ValueError on bad `pass_rates` or `dims` < 1."""
  p = np.clip(_check_pass_rates(pass_rates), 0.01, 0.99)
  _check_int("dims", dims, 1)
  out = rng.standard_normal((p.size, dims))
  out[:, 0] = np.log(p / (1 - p)) + noise * out[:, 0]
  return out.astype(np.float32)


def grpo_signal(pass_rates: np.ndarray, n: int) -> float:
  """Expected fraction of GRPO groups of n responses with signal: 1 - E[p^n + (1-p)^n].

  Args:
    pass_rates: float[P] pass rates in [0, 1].
    n: group size, >= 1.

  Raises:
    ValueError: bad `pass_rates` or `n` (named).
  """
  p = _check_pass_rates(pass_rates)
  _check_int("n", n, 1)
  return float(np.mean(1.0 - p**n - (1.0 - p) ** n))


def pos_closed_form(
  pass_rates: np.ndarray, samples_per_round: int, max_rounds: int
) -> tuple[float, float]:
  """Expected (samples per prompt, signal fraction) of Reinforce-Ada-pos with k_pos = 1.

  Args:
    pass_rates: float[P] pass rates in [0, 1].
    samples_per_round: M, responses per active prompt per round, >= 1.
    max_rounds: R, >= 1.

  Returns:
    (mean over prompts of M * sum_{j<R} (1-p)^{Mj}, mean of 1 - p^M - (1-p)^{MR}).

  Raises:
    ValueError: a bad argument (named).
  """
  p = _check_pass_rates(pass_rates)
  _check_int("samples_per_round", samples_per_round, 1)
  _check_int("max_rounds", max_rounds, 1)
  m, r, q = samples_per_round, max_rounds, 1.0 - p
  samples = m * sum(q ** (m * j) for j in range(r))
  return float(np.mean(samples)), float(np.mean(1.0 - p**m - q ** (m * r)))


def grpo_n_for_signal(pass_rates: np.ndarray, target: float, n_max: int = 256) -> int | None:
  """Smallest GRPO group size whose closed-form signal fraction reaches `target`.

  Returns:
    n in [2, n_max], or None when even n_max falls short.
  """
  p = _check_pass_rates(pass_rates)
  for n in range(2, n_max + 1):
    if grpo_signal(p, n) >= target:
      return n
  return None


def method_table(
  n: int = 4,
  samples_per_round: int = 8,
  max_rounds: int = 4,
  est_budgets: Sequence[float] = (4.0, 8.0),
  est_paper_budgets: Sequence[float] = (8.0,),
  est_head_budgets: Sequence[float] = (8.0,),
) -> dict[str, AdaConfig]:
  """The controller configurations compared in the paper's sampling-cost argument.

  Rows: `grpo_n{4,8,16,32}` (uniform sampling), `dapo_n4` (DAPO dynamic sampling, at most
  4 extra passes), `ada_pos` / `ada_balance` (Reinforce-Ada-Seq exit rules, paper §3),
  `ada_est_k{K}` (Reinforce-Ada-Est as released: w = 1/p̂, 1 sample each and the rest of
  the K·B budget by weight; the paper compares K = 8 with GRPO n = 8) and
  `ada_est_paper_k{K}` (the paper's hybrid, `adaptive.EST_PAPER`: w = 1/sqrt(p̂) clipped
  to [4, 32] samples, f'(p̄) advantage weight) and `ada_est_head_k{K}` (released Est with
  p̂ from the learned pass-rate head on `toy_features`).

  Args:
    n: group size kept per prompt (dapo, pos, balance).
    samples_per_round: M (pos, balance).
    max_rounds: R (pos, balance).
    est_budgets: K of each released-Est row.
    est_paper_budgets: K of each paper-hybrid row (4 <= K <= 32).
    est_head_budgets: K of each learned-head row.

  Returns:
    row name -> `AdaConfig`, in display order.

  Raises:
    ValueError: `AdaConfig` or a row's rule (`rules.rule_for`) rejects a value, named.
  """
  out = {f"grpo_n{g}": AdaConfig(method="grpo", n=g) for g in (4, 8, 16, 32)}
  out["dapo_n4"] = AdaConfig(method="dapo", n=n, dapo=DapoConfig(max_extra_passes=4))
  seq = SeqConfig(samples_per_round=samples_per_round, max_rounds=max_rounds)
  out["ada_pos"] = AdaConfig(method="pos", n=n, seq=seq)
  out["ada_balance"] = AdaConfig(method="balance", n=n, seq=seq)
  rows = [("est", est_budgets, {"est": EstConfig()}), ("est_paper", est_paper_budgets, EST_PAPER)]
  rows.append(("est_head", est_head_budgets, {"est": EstConfig(estimator="head")}))
  for name, budgets, settings in rows:
    for k in budgets:
      est = dataclasses.replace(settings["est"], budget_per_prompt=k)
      out[f"ada_{name}_k{k:g}"] = AdaConfig(method="est", **{**settings, "est": est})
  for cfg in out.values():
    rules.rule_for(cfg)  # settings each row's method cannot run together (M·R < n, ...)
  return out


def _bernoulli_draw(
  rates: list[float], rng: np.random.Generator
) -> Callable[[np.ndarray], np.ndarray]:
  """`DrawEngine`'s draw: float32[N] 0/1 rewards, reward i ~ Bernoulli(rates[prompts[i]])."""

  def draw(prompts: np.ndarray):
    return (rng.random(prompts.size) < np.asarray(rates)[prompts]).astype(np.float32)

  return draw


@dataclasses.dataclass(frozen=True)
class SimResult:
  """Totals of one method over the scored epochs (per prompt = per prompt given to a step).

  Attributes:
    samples_per_prompt: responses drawn / prompts (dapo: includes its extra prompts' draws).
    signal_fraction: prompts whose training group has a non-zero advantage / prompts.
    zero_signal_fraction: training groups whose advantages are all zero / groups.
    rows_selected_per_prompt: responses kept for training / prompts.
    useful_fraction_of_drawn: kept responses with a non-zero advantage / responses drawn.
    mean_rounds: mean rounds (passes) per step.
    active_fraction_per_round: mean fraction of the step's prompts sampled in round 1, 2,
      ... (first 8 rounds; rounds no step reached are left out), rounded to 4 digits.
    scored_prompts: prompts counted (steps of the scored epochs × B).
    true_pass_rate: mean true pass rate p of the scored steps' prompts (dapo: the step's
      own B prompts, not its extra ones).
    first_round_pass_rate: mean over scored steps of `StepStats.first_round_pass_rate`.
    first_round_pass_rate_se: standard error of its difference from `true_pass_rate`
      (step-to-step spread of the per-step differences / sqrt(steps)).
    pool_pass_rate: mean over scored steps of the B prompts' pool pass rates (every
      response drawn), the same for its standard error `pool_pass_rate_se`.
  """

  samples_per_prompt: float
  signal_fraction: float
  zero_signal_fraction: float
  rows_selected_per_prompt: float
  useful_fraction_of_drawn: float
  mean_rounds: float
  active_fraction_per_round: list[float]
  scored_prompts: int
  true_pass_rate: float
  first_round_pass_rate: float
  first_round_pass_rate_se: float
  pool_pass_rate: float
  pool_pass_rate_se: float

  def as_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def simulate(
  cfg: AdaConfig,
  pass_rates: np.ndarray,
  *,
  batch: int,
  epochs: int = 4,
  warmup_epochs: int = 1,
  seed: int = 0,
  mix: Mix = PASS_RATE_MIX,
  feature_noise: float = 1.0,
) -> SimResult:
  """Runs the controller `cfg` on Bernoulli prompts for several epochs; totals its cost.

  Each epoch visits the prompts in a fresh random order, B = `batch` prompts per step (a
  last partial batch is skipped), and calls `controller.run_step` (`rounds`) with a draw
  that returns Bernoulli(p) rewards. Est's pass-rate statistics carry over from step to
  step, keyed by the prompt's index; the first `warmup_epochs` epochs fill them and are
  not scored (the other methods have no state, so for them warm-up epochs only cost time).
  DAPO's extra prompts are fresh pass rates drawn from `mix`.

  Args:
    cfg: the controller configuration (e.g. a `method_table` row).
    pass_rates: float[P] pass rates in [0, 1], one per prompt.
    batch: B, prompts per step, 1 <= B <= P.
    epochs: passes over the prompts, >= 1.
    warmup_epochs: leading epochs not scored, 0 <= warmup_epochs < epochs.
    seed: seeds the order, the rewards (Generator(seed)) and DAPO's extra prompts
      (Generator(seed + 1)).
    mix: the Beta mixture of DAPO's extra prompts.
    feature_noise: `toy_features`' noise (Generator(seed + 2)), for Est's learned head.

  Returns:
    `SimResult`.

  Raises:
    ValueError: a bad argument (named).
  """
  p_all = _check_pass_rates(pass_rates)
  _check_int("batch", batch, 1)
  if batch > p_all.size:
    raise ValueError(f"batch={batch}: more than the {p_all.size} prompts of pass_rates")
  _check_int("epochs", epochs, 1)
  _check_int("warmup_epochs", warmup_epochs, 0)
  if warmup_epochs >= epochs:
    raise ValueError(f"warmup_epochs={warmup_epochs}: must be < epochs={epochs}")
  rng = np.random.default_rng(seed)
  extra_rng = np.random.default_rng(seed + 1)
  features = toy_features(p_all, np.random.default_rng(seed + 2), feature_noise)
  method_state = None
  tot = dict(prompts=0, samples=0, signal=0, zero_groups=0, groups=0, selected=0, useful=0)
  rounds, active, truth, first, pool = [], [], [], [], []
  for epoch in range(epochs):
    order = rng.permutation(p_all.size)
    for start in range(0, p_all.size - batch + 1, batch):
      ids = order[start : start + batch]
      rates = list(p_all[ids])

      def more_prompts(k, rates=rates):
        rates.extend(sample_pass_rates(extra_rng, k, mix))
        return [f"extra{len(rates) - k + i}" for i in range(k)]

      res, method_state = controller.run_step(
        cfg,
        [f"p{i}" for i in ids],
        controller.DrawEngine(_bernoulli_draw(rates, rng)),
        rng,
        method_state,
        more_prompts=more_prompts,
        features=features[ids],
        schedule="rounds",
      )
      if epoch < warmup_epochs:
        continue
      s = res.stats
      groups = np.unique(res.prompt_index).size
      tot["prompts"] += s.num_prompts
      tot["samples"] += s.rows_requested
      tot["signal"] += round(s.signal_fraction * s.num_prompts)
      tot["groups"] += groups
      tot["zero_groups"] += round(s.zero_signal_fraction * groups)
      tot["selected"] += s.rows_selected
      tot["useful"] += s.rows_useful
      rounds.append(len(s.samples_per_round))
      truth.append(float(np.mean(p_all[ids])))
      first.append(s.first_round_pass_rate)
      pool.append(float(np.mean(s.pool_pass_rate[:batch])))
      active.append(np.pad(s.active_per_round, (0, 8))[:8] / s.num_prompts)
  return SimResult(
    samples_per_prompt=tot["samples"] / tot["prompts"],
    signal_fraction=tot["signal"] / tot["prompts"],
    zero_signal_fraction=tot["zero_groups"] / max(tot["groups"], 1),
    rows_selected_per_prompt=tot["selected"] / tot["prompts"],
    useful_fraction_of_drawn=tot["useful"] / tot["samples"],
    mean_rounds=float(np.mean(rounds)),
    active_fraction_per_round=[round(float(x), 4) for x in np.mean(active, 0) if x > 0],
    scored_prompts=tot["prompts"],
    true_pass_rate=float(np.mean(truth)),
    first_round_pass_rate=float(np.mean(first)),
    first_round_pass_rate_se=_standard_error(np.subtract(first, truth)),
    pool_pass_rate=float(np.mean(pool)),
    pool_pass_rate_se=_standard_error(np.subtract(pool, truth)),
  )


def _standard_error(x: np.ndarray) -> float:
  return float(np.std(x, ddof=1) / np.sqrt(x.size)) if x.size > 1 else float("nan")


def trace_step(
  cfg: AdaConfig, pass_rates: Sequence[float], seed: int = 0
) -> tuple[StepResult, list[np.ndarray]]:
  """One controller step on Bernoulli prompts, keeping every round's rewards.

  For worked examples: which prompts were sampled in which round, what they scored, which
  responses were kept and with which advantages (`StepResult.advantages`; the pool of
  prompt i is the concatenation of its rewards over the rounds).

  Args:
    cfg: the controller configuration (not dapo: it would need extra prompts).
    pass_rates: the step's B pass rates in [0, 1].
    seed: seeds the rewards (and `seq.selection='random'`).

  Returns:
    (the `StepResult`, one float32[B, draws] array per round: prompt i's rewards of that
    round in arrival order, NaN where it drew fewer, e.g. after it exited).
  Raises ValueError on bad `pass_rates` or a dapo `cfg`.
  """
  p = _check_pass_rates(pass_rates)
  if rules.rule_for(cfg).adds_prompts:
    raise ValueError(f"cfg: trace_step does not support method={cfg.method!r} (extra prompts)")
  rng, rounds = np.random.default_rng(seed), []
  draw = _bernoulli_draw(list(p), rng)

  def recording_draw(prompts: np.ndarray):
    rewards = draw(prompts)
    per_prompt = [rewards[prompts == i] for i in range(p.size)]
    table = np.full((p.size, max(len(r) for r in per_prompt)), np.nan, np.float32)
    for i, r in enumerate(per_prompt):
      table[i, : len(r)] = r
    rounds.append(table)
    return rewards

  engine, ids = controller.DrawEngine(recording_draw), [f"p{i}" for i in range(p.size)]
  result, _ = controller.run_step(cfg, ids, engine, rng, schedule="rounds")
  return result, rounds


def closed_form_checks(
  rows: Mapping[str, SimResult], pass_rates: np.ndarray, samples_per_round: int, max_rounds: int
) -> dict[str, dict[str, Any]]:
  """Simulated vs closed-form figures for the `grpo_n*` and `ada_pos` rows present.

  Returns:
    `grpo_n<g>`: {simulated, closed_form, abs_err} signal fractions; `ada_pos`:
    {simulated, closed_form} as [samples per prompt, signal fraction] (assumes the row used
    `samples_per_round` and `max_rounds` and k_pos = 1).
  """
  checks: dict[str, dict[str, Any]] = {}
  for name, row in rows.items():
    if name.startswith("grpo_n"):
      sim, exact = row.signal_fraction, grpo_signal(pass_rates, int(name[len("grpo_n") :]))
      checks[name] = {"simulated": sim, "closed_form": exact, "abs_err": abs(sim - exact)}
  if "ada_pos" in rows:
    row = rows["ada_pos"]
    checks["ada_pos"] = {
      "simulated": [row.samples_per_prompt, row.signal_fraction],
      "closed_form": list(pos_closed_form(pass_rates, samples_per_round, max_rounds)),
    }
  return checks


def markdown_table(rows: Mapping[str, SimResult], pass_rates: np.ndarray) -> list[str]:
  """Lines of a Markdown table: samples/prompt, signal and zero-signal fractions, the
  GRPO group size that reaches the same signal in closed form (`grpo_n_for_signal`), and
  the error of the first-round and pool pass rates against the true mean pass rate."""
  lines = [
    "| method | samples/prompt | signal fraction | zero-signal groups | GRPO n, same signal "
    "| first-round pass rate − true (± se) | pool pass rate − true (± se) |",
    "|---|---|---|---|---|---|---|",
  ]
  for name, r in rows.items():
    lines.append(
      f"| {name} | {r.samples_per_prompt:.2f} | {r.signal_fraction:.3f} | "
      f"{r.zero_signal_fraction:.3f} | {grpo_n_for_signal(pass_rates, r.signal_fraction)} | "
      f"{r.first_round_pass_rate - r.true_pass_rate:+.4f} ± {r.first_round_pass_rate_se:.4f} | "
      f"{r.pool_pass_rate - r.true_pass_rate:+.4f} ± {r.pool_pass_rate_se:.4f} |"
    )
  return lines


def plot_cost_vs_signal(
  rows: Mapping[str, SimResult], pass_rates: np.ndarray, ax=None, n_max: int = 48
):
  """Plots signal fraction vs samples per prompt: the GRPO closed-form curve for n = 2 ..
  n_max and one marker per row (circles GRPO, squares Reinforce-Ada, triangles DAPO).

  Args:
    rows: row name -> `SimResult`.
    pass_rates: the prompts' pass rates (for the closed-form curve).
    ax: a matplotlib Axes; None: a new 7 x 4.5 in figure.

  Returns:
    The Axes.
  """
  import matplotlib.pyplot as plt

  if ax is None:
    _, ax = plt.subplots(figsize=(7, 4.5))
  ns = np.arange(2, n_max + 1)
  ax.plot(ns, [grpo_signal(pass_rates, n) for n in ns], "k-", lw=1, label="GRPO n, closed form")
  for name, row in rows.items():
    marker = "o" if name.startswith("grpo") else ("s" if name.startswith("ada") else "^")
    xy = (row.samples_per_prompt, row.signal_fraction)
    ax.plot(*xy, marker, ms=7, label=name)
    # Est labels go right of their points: they share x with GRPO's n = 4 and 8 markers.
    offset, align = {"ada_est": ((7, -9), "left"), "ada": ((5, 6), "left")}.get(
      next((k for k in ("ada_est", "ada") if name.startswith(k)), ""), ((5, -10), "left")
    )
    ax.annotate(name, xy, textcoords="offset points", xytext=offset, fontsize=7, ha=align)
  ax.set_xlabel("samples drawn per prompt")
  ax.set_ylabel("fraction of prompts with learning signal")
  ax.set_title("Sampling cost vs signal (Bernoulli prompts, Beta-mix pass rates)")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7, loc="lower right")
  return ax
