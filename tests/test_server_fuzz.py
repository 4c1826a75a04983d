"""schemathesis against the live server's OpenAPI schema (`slow`; needs the optional `fuzz` extra, skipped
without it): a bounded run (at most 15 examples per operation and phase, 120 s) that finds no 5xx.

    pip install -e '.[fuzz,serve-test]' && python -m pytest -q -m slow tests/test_server_fuzz.py -n 0
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("schemathesis")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("multipart")
pytest.importorskip("httpx")

from tests.test_server import Server  # noqa: E402


@pytest.mark.slow
def test_schemathesis_finds_no_server_error(tmp_path):
    cli = shutil.which("schemathesis") or str(Path(sys.executable).with_name("schemathesis"))
    s = Server(tmp_path, "wan", "--variant", "tiny", "--max-queue", "2")
    try:
        r = subprocess.run([cli, "run", f"{s.url}/openapi.json", "--checks", "not_a_server_error",
                            "--max-examples", "15", "--max-time", "120", "--workers", "1", "--seed", "22",
                            "--request-timeout", "30", "--no-shrink", "--no-color"],
                           capture_output=True, text=True, timeout=400, cwd=tmp_path,
                           env={**os.environ, "SCHEMATHESIS_HOOKS": ""})
        out = r.stdout + r.stderr
        assert r.returncode == 0, out[-6000:]
        ran = re.search(r"Test cases:\s+(\d+) generated, (\d+) passed", out)   # not a phase's "7 passed"
        assert ran and int(ran.group(2)) >= 50, out[-3000:]     # the fuzzer really sent cases
        assert not re.search(r"\d+ failed", out), out[-6000:]
    finally:
        s.stop()
    assert "Traceback" not in (tmp_path / "server.log").read_text()
