"""tools/gpu/sglang-0.5.17/hybrid_live.sh and hybrid_probe.py on this CPU (``pytest tools/gpu/tests``).

The live run needs SGLang on a GPU; here the driver's shell is checked to parse and to print its usage,
the launch argv it builds from the preset is the preset's (with the host flags after it, where the later
flag wins), and the probe is run against the SGLang emulator of ``tests/fakes``: the histogram it sums
matches the scalar counters, and the radix-cache requests report cached tokens.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SGL = REPO / "tools" / "gpu" / "sglang-0.5.17"
HYBRID = REPO / "fixtures" / "models" / "hybrid"


def test_driver_parses_and_prints_its_usage(tmp_path):
    assert subprocess.run(["bash", "-n", str(SGL / "hybrid_live.sh")]).returncode == 0
    out = subprocess.run(["bash", str(SGL / "hybrid_live.sh")], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "SPECPARITY_LIVE_WORK": str(tmp_path)})
    assert out.returncode == 4
    assert "hybrid_live.sh start" in out.stdout and "max_running_requests is capped to N" in out.stdout


def test_the_launch_argv_is_the_presets_with_the_host_flags_after_it():
    from specparity.engines.base import EngineOptions
    from specparity.engines.server.sglang_launch import launch_configs

    host = "--attention-backend triton --context-length 2048 --mem-fraction-static 0.3"
    base, spec = launch_configs(EngineOptions(target=str(HYBRID), preset="sglang-mtp",
                                              extra={"server_args": shlex.split(host)}))
    b, s = base.args(), spec.args()
    assert b[-len(shlex.split(host)):] == shlex.split(host)
    assert "--speculative-algorithm" not in b and s[s.index("--speculative-algorithm") + 1] == "EAGLE"
    # the preset's 32K context comes first, the host's 2048 last: argparse keeps the last
    assert [b[i + 1] for i, a in enumerate(b) if a == "--context-length"] == ["32768", "2048"]
    assert s[s.index("--max-running-requests") + 1] == "16"


@pytest.fixture(scope="module")
def fake_spec_server():
    sys.path.insert(0, str(REPO / "tests"))
    from fakes.sglang import SGLangServer

    server = SGLangServer(speculative=True, prefix_cache=True).start()
    yield server.url
    server.stop()


def _probe(mode: str, url: str, out: Path, *extra: str) -> dict:
    cmd = [sys.executable, str(SGL / "hybrid_probe.py"), mode, url, "--tokenizer", str(HYBRID), "--out", str(out), *extra]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    assert Path(str(out) + ".md").read_text().startswith("# ")
    return json.loads(Path(str(out) + ".json").read_text())


def test_probe_sums_the_acceptance_histogram(fake_spec_server, tmp_path):
    d = _probe("accept", fake_spec_server, tmp_path / "acc", "--concurrency", "4")
    assert d["prompts"] == 54 and not d["missing_histogram"]
    assert d["verify_steps_from_histogram"] == d["totals"]["verify"]
    assert d["accepted_from_histogram"] == d["totals"]["accepted"]
    per = d["per_position_acceptance"]
    assert per and all(a >= b for a, b in zip(per, per[1:]))  # acceptance falls with the position


def test_probe_reads_cached_tokens(fake_spec_server, tmp_path):
    d = _probe("cache", fake_spec_server, tmp_path / "cache")
    assert d["prompts"] == 54
    # the emulator caches every prompt but its last token: both later requests hit
    assert d["same"]["hits"] == 54 and d["extended"]["hits"] == 54
    assert all(r["extended_cached"] == r["prompt_tokens"] for r in d["rows"])
