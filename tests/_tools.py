"""Tools the tests need from the machine: found or skipped (failed in CI), and what they make."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest


def required(tool: str) -> str:
    """The path of ``tool``: locally a missing one skips, in CI (which installs it) it fails."""
    found = shutil.which(tool) or next(
        (f"{d}/{tool}" for d in ("/usr/sbin", "/sbin") if Path(f"{d}/{tool}").exists()), None
    )
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(f"CI needs {tool} (.ci/run installs it)")
        pytest.skip(f"needs {tool}")
    return found


def self_signed(directory: Path) -> tuple[Path, Path]:
    openssl = required("openssl")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=leases.example.com",
            "-addext",
            "subjectAltName=DNS:leases.example.com,IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key
