"""Flags a user mistypes are refused before anything starts: preflight's TP, serve's sizes."""

import pytest

from gemma_nb.__main__ import main as cli
from gemma_nb.serving import serve


def test_preflight_refuses_tp_zero(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli(["preflight", "--target", "cpu", "--tp", "0"])
    assert exit_info.value.code == 2 and "argument --tp: '0'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-context", "-5"], "--max-context -5 must be at least 1"),
        (["--queue-size", "0"], "--queue-size 0 must be at least 1"),
    ],
)
def test_serve_checks_its_sizes_before_the_server_starts(monkeypatch, capsys, flags, message):
    import uvicorn

    def no_server(*args, **kwargs):
        raise AssertionError("the server was started with a bad flag")

    monkeypatch.setattr(uvicorn, "Server", no_server)
    assert serve.main(flags) == 2
    assert message in capsys.readouterr().err
