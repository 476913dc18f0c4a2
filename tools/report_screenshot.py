"""Photograph a triage report (report.html) with headless Chromium: docs/report-screenshot.png.

    python tools/report_screenshot.py
        runs a small real gate (the hand-written loop of tests/broken_loops.py with the short_crop
        bug, bf16, prompts from prompts/near_tie.jsonl and prompts/default.jsonl: at least one
        near-tie flip and one divergence), writes its report and photographs it;
    python tools/report_screenshot.py --html REPORT_DIR/report.html
        photographs an existing report instead (e.g. an fp8 KV-cache server run:
        ``specparity run ... --report REPORT_DIR`` or ``pytest suites/lossless ... --report REPORT_DIR``).

By default the photograph is "focused": it keeps the first near-tie and the first diverged prompt
of the non-exact list and hides the others (in a copy of the page; the report itself is not
changed), so one 1280×2400 window shows the verdict, the class table, a near tie and a
divergence side by side with their reasoning, and the margin plot. ``--no-focus`` photographs the
page as it is.

Chromium: Debian's ``chromium-headless-shell`` (or ``chromium``); ``--chromium PATH`` or the
environment variable ``SPECPARITY_CHROMIUM`` names another binary. tests/test_report_browser.py
uses the helpers here.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: Binaries tried in order (Debian: apt-get install chromium-headless-shell, or chromium).
CHROMIUM_BINARIES = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
#: Prompts of the demo run: near-tie candidates, prompts the short_crop bug breaks, exact controls.
DEMO_PROMPTS = ("neartie-mix-002", "neartie-raw-074", "neartie-raw-078", "neartie-raw-000", "neartie-raw-010",
                "logic-en-003", "code-en-003", "math-en-004")
DEFAULT_OUT = REPO / "docs" / "report-screenshot.png"


def find_chromium(explicit: str | None = None) -> str | None:
    """The headless Chromium binary to use: ``explicit``, ``$SPECPARITY_CHROMIUM``, else the first of
    :data:`CHROMIUM_BINARIES` on PATH (None: none found)."""
    for name in (explicit, os.environ.get("SPECPARITY_CHROMIUM"), *CHROMIUM_BINARIES):
        if name:
            path = shutil.which(name)
            if path:
                return path
    return None


def _chromium(binary: str, args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory(prefix="specparity-chromium-") as profile:
        cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--disable-dev-shm-usage",
               "--no-first-run", "--disable-extensions", "--mute-audio", f"--user-data-dir={profile}", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return proc


def dump_dom(binary: str, html: Path, timeout: float = 120) -> str:
    """The page's DOM after Chromium loaded and laid it out (``--dump-dom``)."""
    return _chromium(binary, ["--dump-dom", Path(html).resolve().as_uri()], timeout).stdout


def screenshot(binary: str, html: Path, png: Path, width: int = 1280, height: int = 2400, timeout: float = 120) -> Path:
    """A ``width`` × ``height`` PNG of the top of the page."""
    png = Path(png).resolve()
    png.parent.mkdir(parents=True, exist_ok=True)
    png.unlink(missing_ok=True)
    _chromium(binary, [f"--screenshot={png}", f"--window-size={width},{height}", Path(html).resolve().as_uri()],
              timeout)
    if not png.exists():
        raise RuntimeError(f"chromium wrote no screenshot to {png}")
    return png


def png_size(png: Path) -> tuple[int, int]:
    """(width, height) from the PNG's IHDR chunk."""
    head = Path(png).read_bytes()[:24]
    if head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR":
        raise ValueError(f"{png} is not a PNG")
    return struct.unpack(">II", head[16:24])


def focused_copy(html: Path, out: Path, keep: tuple[str, ...] = ("near_tie", "diverged")) -> Path:
    """A copy of the report that shows, of the non-exact prompts, only the first of each class in
    ``keep`` (and none of the per-prompt index rows, collapsed details stay collapsed)."""
    page = Path(html).read_text(encoding="utf-8")
    cards = re.findall(r'<div class="card flip ([^"]+)" id="([^"]+)"', page)
    shown = []
    for klass in keep:
        ids = [anchor for k, anchor in cards if k == klass]
        if ids:
            shown.append(ids[0])
    css = ".card.flip{display:none}#flip-index{display:none}"
    if shown:
        css += ",".join(f"#{a}" for a in shown) + "{display:block}"
    Path(out).write_text(page.replace("</style>", css + "</style>", 1), encoding="utf-8")
    return Path(out)


def demo_run(report_dir: Path, *, dtype: str = "bfloat16", bug: str | None = "short_crop",
             near_tie_nats: float | None = None, prompt_ids: tuple[str, ...] = DEMO_PROMPTS, max_new_tokens: int = 32):
    """A real gate run over the hand-written loop (tests/broken_loops.py) that writes its reports to
    ``report_dir``; returns (run, decision)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(REPO / "tests"))
    from broken_loops import LoopEngine  # noqa: PLC0415 - the test helpers are not a package

    from specparity.engines.base import EngineOptions
    from specparity.model.locations import fixture_dir
    from specparity.model.prompts import load_prompts
    from specparity.model.gate_run import GateConfig, GatePolicy
    from specparity.run.runner import conclude, run_gate

    pool = [p for f in ("near_tie.jsonl", "default.jsonl") for p in load_prompts(REPO / "prompts" / f).prompts]
    by_id = {p.id: p for p in pool}
    prompts = [by_id[i] for i in prompt_ids]
    options = EngineOptions(target=str(fixture_dir("target")), draft=str(fixture_dir("draft")), spec_mode="draft",
                            dtype=dtype)
    engine = LoopEngine(options, bug)
    try:
        config = GateConfig(max_new_tokens=max_new_tokens, near_tie_nats=near_tie_nats, report_dir=str(report_dir),
                            policy=GatePolicy(max_near_tie=1.0))
        run = run_gate(engine, prompts, config)
    finally:
        engine.close()
    return run, conclude(run)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--html", type=Path, help="photograph this report.html instead of running the demo gate")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--report-dir", type=Path, help="where the demo run writes its reports (default: a temp dir)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--bug", default="short_crop", help="tests/broken_loops.py bug ('none': the correct loop)")
    ap.add_argument("--near-tie-nats", type=float, default=None)
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--height", type=int, default=2400)
    ap.add_argument("--no-focus", action="store_true", help="photograph the whole page as it is")
    ap.add_argument("--chromium", help="the Chromium binary (default: found on PATH)")
    args = ap.parse_args(argv)
    binary = find_chromium(args.chromium)
    if binary is None:
        print(f"no Chromium found (tried {', '.join(CHROMIUM_BINARIES)}): apt-get install chromium-headless-shell",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="specparity-shot-") as tmp:
        html = args.html
        if html is None:
            report_dir = args.report_dir or Path(tmp) / "report"
            run, decision = demo_run(report_dir, dtype=args.dtype, bug=None if args.bug == "none" else args.bug,
                                     near_tie_nats=args.near_tie_nats)
            print(f"demo run: {decision.status}, {decision.counts}; reports in {report_dir}")
            if not decision.counts["near_tie"] or not decision.counts["diverged"]:
                print("warning: the run has no near tie or no divergence on this CPU (bf16 flips depend on the "
                      "kernels); try --dtype float32 --near-tie-nats 1", file=sys.stderr)
            html = report_dir / "report.html"
        page = html if args.no_focus else focused_copy(html, Path(tmp) / "focused.html")
        png = screenshot(binary, page, args.out, args.width, args.height)
    w, h = png_size(png)
    print(f"{png}: {w}×{h}, {png.stat().st_size / 1024:.0f} KiB ({binary})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
