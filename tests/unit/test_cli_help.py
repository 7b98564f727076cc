"""`pdserve --help` tells the defaults that differ between the offline engine and the server."""

from __future__ import annotations

import pytest

from pdserve.cli import main


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines


def test_serve_help_says_requests_default_to_temperature_1(capsys):
    text = _help(capsys, "serve")
    assert "temperature 1.0" in text and "pdserve generate" in text


def test_generate_help_says_its_default_differs_from_the_servers(capsys):
    text = _help(capsys, "generate")
    assert "default: 0" in text and "temperature 1.0" in text
