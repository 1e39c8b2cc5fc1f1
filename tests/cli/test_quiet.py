"""What a newcomer sees: no third-party progress bars or deprecation warnings in the CLI's output
(``--debug`` keeps them)."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import make_tiny_hf_dir


def _export(tmp_path, *extra: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY")}
    env.update(KVTRACE_CACHE=str(tmp_path / "cache"), PYTHONWARNINGS="default")  # every warning shown, normally
    proc = subprocess.run([sys.executable, "-m", "kvtrace.cli", "export", str(tmp_path / "hf"), "-o",
                           str(tmp_path / "m.kvt"), "--max-seq-len", "16", *extra], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def test_export_shows_kvtrace_progress_only(tmp_path):
    (tmp_path / "hf").mkdir()
    make_tiny_hf_dir(tmp_path / "hf")
    err = _export(tmp_path)
    assert "loading model" in err and "capturing programs" in err  # kvtrace's own lines
    assert "Loading weights" not in err and "it/s" not in err  # transformers' tqdm bar
    assert "Warning" not in err, err
    # torchao (installed with the executorch extra; transformers imports it) and torch's pytree log through logging
    assert "Failed to load" not in err and "_pytree" not in err, err
    debug = _export(tmp_path, "--debug")
    assert "Loading weights" in debug  # the libraries' output is still there for whoever asks
