"""fvgen: prompt -> video file with random weights (--variant, no checkpoint) in a subprocess, progress bars on stderr,
the summary on stdout, exit codes 0 / 1 / 2 / 3 as the other CLIs, `fvgen card`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from optimized.serving import fvgen
from parity.artifacts import read_png_frames

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "optimized.serving.fvgen", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_wan_tiny_to_png_frames_with_progress(tmp_path):
    out = tmp_path / "frames"
    p = run_cli("wan", "--variant", "tiny", "--prompt", "hi", "--steps", "3", "--frames", "5", "--size", "48x32",
                "--seed", "4", "--out", str(out))
    assert p.returncode == 0, p.stderr
    summary = json.loads(p.stdout)
    assert summary["frames"] == [5, 32, 48, 3] and summary["seed"] == 4
    assert summary["weights_version"] == "random:wan:tiny-2.1-t2v:0"
    assert read_png_frames(out).shape == (5, 32, 48, 3)
    side = json.loads((out / "video.json").read_text())
    assert side["request"]["text_ids"] == [ord("h"), ord("i")]     # the byte-level fallback (no tokenizer files)
    assert side["request"]["num_steps"] == 3 and side["request"]["height"] == 32 and side["request"]["width"] == 48
    # stderr is a pipe here: plain progress lines (a log's), no redrawn bars
    assert "denoise: 3/3 steps" in p.stderr and "decode: 2/2 chunks" in p.stderr and "\r" not in p.stderr
    assert [x.name for x in tmp_path.iterdir()] == ["frames"]


def test_cosmos3_tiny_mp4_with_image_and_card(tmp_path):
    pytest.importorskip("imageio_ffmpeg")
    from PIL import Image
    Image.fromarray((np.indices((32, 32)).sum(0) * 4 % 255).astype("uint8")).convert("RGB").save(tmp_path / "in.png")
    clip = tmp_path / "clip.mp4"
    p = run_cli("cosmos3", "--variant", "tiny", "--prompt-ids", "1,2,3", "--image", str(tmp_path / "in.png"),
                "--steps", "2", "--out", str(clip), "--quiet")
    assert p.returncode == 0, p.stderr
    assert clip.read_bytes()[4:8] == b"ftyp" and p.stderr == ""
    side = json.loads((tmp_path / "clip.json").read_text())
    assert side["request"]["vision_condition_frames"] == [0] and side["request"]["text_ids"] == [1, 2, 3]
    card = run_cli("card", "cosmos3", "--variant", "tiny")
    assert card.returncode == 0, card.stderr
    c = json.loads(card.stdout)
    assert c["family"] == "cosmos3" and c["variant"] == "tiny" and c["buckets_captured"] == []
    assert c["media_weights_version"].startswith("random:")


def test_help_answers_questions():
    p = run_cli("--help")
    assert p.returncode == 0
    for needle in ("--variant", "--prompt-ids", "byte-level", "WIDTHxHEIGHT", "Exit codes", "fvgen card", "--plan"):
        assert needle in p.stdout, needle


def run_main(argv: list[str], capsys) -> tuple[int, str]:
    code = fvgen.main(argv)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    (["wan", "--variant", "tiny", "--prompt", "x", "--plan", "cfgp2", "--out", "{tmp}/a"], "only 'none'"),
    (["wan", "--variant", "tiny", "--model", "{tmp}", "--prompt", "x", "--out", "{tmp}/a"], "exactly one"),
    (["wan", "--variant", "nosuch", "--prompt", "x", "--out", "{tmp}/a"], "no variant 'nosuch'"),
    (["nosuch", "--variant", "tiny", "--prompt", "x", "--out", "{tmp}/a"], "unknown family"),
    (["wan", "--variant", "tiny", "--prompt", "x", "--size", "30x32", "--out", "{tmp}/a"], "height and width"),
    (["wan", "--variant", "tiny", "--prompt", "x", "--frames", "6", "--out", "{tmp}/a"], "4k+1"),
    (["wan", "--variant", "tiny", "--prompt", "x", "--size", "big", "--out", "{tmp}/a"], "WIDTHxHEIGHT"),
    (["wan", "--variant", "tiny", "--prompt", "x", "--out", "{tmp}"], "already exists"),
    (["wan", "--variant", "tiny", "--prompt", "x", "--out", "{tmp}/a.gif"], ".mp4 or name a directory"),
    (["wan", "--variant", "tiny", "--prompt", "x"], "--out is required"),
    (["wan", "--model", "{tmp}/none", "--prompt", "x", "--out", "{tmp}/a"], "no such directory"),
    (["wan", "--variant", "tiny", "--prompt-ids", "1,z", "--out", "{tmp}/a"], "comma-separated"),
    (["wan", "--variant", "tiny", "--prompt", "x", "--image", "{tmp}/none.png", "--out", "{tmp}/a"], "--image"),
])
def test_usage_errors_exit_2_and_write_nothing(tmp_path, capsys, argv, needle):
    code, err = run_main([a.replace("{tmp}", str(tmp_path)) for a in argv], capsys)
    assert code == 2 and needle in err, err
    assert list(tmp_path.iterdir()) == []


def test_mp4_without_the_video_extra_exits_2_naming_it(tmp_path, capsys, monkeypatch):
    import optimized.runtime.artifacts as artifacts
    monkeypatch.setattr(artifacts, "ffmpeg_exe", lambda: None)
    code, err = run_main(["wan", "--variant", "tiny", "--prompt", "x", "--out", str(tmp_path / "c.mp4")], capsys)
    assert code == 2 and "video` extra" in err and "imageio-ffmpeg" in err


def test_a_failed_generation_exits_1_and_a_bug_exits_3(tmp_path, capsys, monkeypatch):
    import optimized.programs as programs

    def broken_finish(self, video):
        raise FloatingPointError("non-finite frames")

    monkeypatch.setattr(programs.VideoProgram, "_finish", broken_finish)
    code, err = run_main(["wan", "--variant", "tiny", "--prompt", "x", "--steps", "1", "--out",
                          str(tmp_path / "f")], capsys)
    assert code == 1 and "non-finite frames" in err and list(tmp_path.iterdir()) == []
    monkeypatch.setattr(fvgen, "_run_generate", lambda argv: 1 / 0)
    code, err = run_main(["wan"], capsys)
    assert code == 3 and "ZeroDivisionError" in err and "internal error" in err


# ---- issue 22: outputs checked before compute (F15, F22), one message for a bad device (F17), SIGTERM (F16)
@pytest.mark.parametrize("out, needle", [
    ("{tmp}/file.txt/clip", "cannot be written"),              # F15: found after the whole generation (rc 1)
    ("{tmp}/file.txt/deeper/clip", "cannot be written"),
    ("{tmp}/model/clip", "inside the model directory"),         # F22: written into the model directory
    ("{tmp}/model/sub/clip.mp4", "inside the model directory"),
])
def test_an_unusable_out_exits_2_before_the_engine_loads(tmp_path, capsys, monkeypatch, out, needle):
    (tmp_path / "file.txt").write_text("not a directory")
    (tmp_path / "model").mkdir()
    monkeypatch.setattr(fvgen, "load_engine", lambda *a, **k: pytest.fail("the engine loaded before --out was checked"))
    code, err = run_main(["wan", "--model", str(tmp_path / "model"), "--prompt-ids", "1,2", "--out",
                          out.replace("{tmp}", str(tmp_path))], capsys)
    assert code == 2 and needle in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt", "model"]
    assert list((tmp_path / "model").iterdir()) == []


@pytest.mark.parametrize("device", ["tpu", "cuda:x", ""])
def test_an_unknown_device_exits_2_with_one_message(tmp_path, capsys, device):
    code, err = run_main(["wan", "--variant", "tiny", "--prompt-ids", "1,2", "--device", device, "--out",
                          str(tmp_path / "a")], capsys)
    assert code == 2 and "must be one of cpu, cuda, cuda:N" in err and "Traceback" not in err, err
    assert err.count("\n") == 1


SIGTERM_CHILD = """
import sys, time
import optimized.runtime.artifacts as artifacts
from optimized.serving import fvgen
real = artifacts.png_bytes
def slow_png(rgb):
    print("WRITING", file=sys.stderr, flush=True)
    time.sleep(0.3)              # a long write: SIGTERM lands while the temp directory holds frames
    return real(rgb)
artifacts.png_bytes = slow_png
sys.exit(fvgen.main(sys.argv[1:]))
"""


def test_sigterm_while_writing_leaves_no_temp_files_and_exits_1(tmp_path):
    """F16: SIGTERM of fvgen left its temp PNG directory behind."""
    import signal
    import time
    proc = subprocess.Popen([sys.executable, "-c", SIGTERM_CHILD, "wan", "--variant", "tiny", "--prompt-ids", "1,2",
                             "--steps", "1", "--frames", "9", "--quiet", "--out", str(tmp_path / "frames")],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    line = ""
    while "WRITING" not in line and time.monotonic() < deadline:
        line = proc.stderr.readline()
        assert line or proc.poll() is None, "fvgen ended before writing"
    time.sleep(0.7)   # at least one frame is in the temp directory
    assert any(p.name.endswith(".tmp") for p in tmp_path.iterdir()), list(tmp_path.iterdir())
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    assert list(tmp_path.iterdir()) == [], "temp files left behind after SIGTERM"


def test_progress_bars_only_on_a_terminal():
    import io
    from types import SimpleNamespace as Ev

    events = [Ev(kind="request.stage", data={"stage": "denoise", "total": 20})] + \
        [Ev(kind="progress", data={"step": i}) for i in range(1, 21)] + [Ev(kind="request.completed", data={})]
    log, tty = io.StringIO(), io.StringIO()
    for stream, is_tty in ((log, False), (tty, True)):
        p = fvgen.Progress(stream, tty=is_tty)
        for ev in events:
            p(ev)
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and lines[0] == "denoise: 0/20 steps" and lines[-1] == "denoise: 20/20 steps"
    assert len(lines) == 11                                           # the start, then each 10%
    assert tty.getvalue().count("\r") == 21 and tty.getvalue().endswith("20/20 steps\n")
