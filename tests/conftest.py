"""Test-wide set-up: 8 fake CPU devices, forced before JAX is first imported; the
property tests' hypothesis profile."""

import os

# Must run before any `import jax`: XLA reads the flag once, at backend start-up.
# pytest-xdist's workers inherit the flag from the process that started them: set it once.
_FLAGS = [
  f
  for f in os.environ.get("XLA_FLAGS", "").split()
  if not f.startswith("--xla_force_host_platform_device_count=")
]
os.environ["XLA_FLAGS"] = " ".join([*_FLAGS, "--xla_force_host_platform_device_count=8"])
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu (the TPU compiler of tests/test_aot.py) locks a file per process unless told that
# several processes may load it: the multi-process tests start several.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# Tests must never reach the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TFDS_DISABLE_GCS", "1")

import pathlib  # noqa: E402

import hypothesis  # noqa: E402
import pytest  # noqa: E402

# Property tests draw the same examples on every run ("ci", the default), so a red suite is
# a change's fault and can be rerun; HYPOTHESIS_PROFILE=explore draws fresh ones to hunt
# for new failures (what a failure there finds becomes a fixed example).
hypothesis.settings.register_profile("ci", derandomize=True)
hypothesis.settings.register_profile("explore", derandomize=False)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

SHARED = pathlib.Path(__file__).resolve().parents[2] / "shared"


@pytest.fixture(scope="session")
def shared_dir() -> pathlib.Path:
  """The read-only `../shared` folder (real data and tokenizers); skips when absent."""
  if not (SHARED / "data").is_dir():
    pytest.skip(f"../shared not present at {SHARED}: real-data test skipped")
  return SHARED


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
  """`ada_jax.data`'s network probe answers "offline" without trying (where a test has
  imported the module): no test reaches the network, and a missing file fails at once."""
  import sys

  data = sys.modules.get("ada_jax.data.sets")
  if data is not None:
    monkeypatch.setattr(data, "reachable", lambda url, timeout_s=3.0: False)


@pytest.fixture(scope="session")
def no_implicit_transfers():
  """A context manager under which an implicit host-to-device or device-to-device
  transfer (a numpy array or Python scalar fed to a jitted step, `x + 1` on a device
  array) fails and explicit ones (`jax.device_put`, `jax.device_get`) pass; big_vision
  runs its whole training under this level. The step paths are exercised under it, so an
  accidental transfer in a step fails a test instead of slowing a TPU run. (On CPU a
  device-to-host read is zero-copy and never trips it.)"""
  import jax

  return lambda: jax.transfer_guard("disallow")
