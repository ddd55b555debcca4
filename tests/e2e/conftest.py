"""Server fixtures: live `m3serve serve` subprocesses on the tiny model and an in-process app
over a scripted engine stand-in (helpers in serverutil.py), each torn down at session end."""

import pytest

from serverutil import InProcessServer, LiveServer


@pytest.fixture(scope="session")
def server(tiny_dir, tmp_path_factory):
    """The tiny model with both parsers on and default limits."""
    srv = LiveServer(tiny_dir, "--reasoning-parser", "minimax_m3", "--tool-call-parser", "minimax_m3",
                     "--enable-auto-tool-choice", "--max-num-seqs", "8",
                     log_path=tmp_path_factory.mktemp("logs") / "server.log")
    yield srv
    srv.stop()
    assert srv.proc.returncode == 0, srv.log_path.read_text()[-3000:]     # drained, then exit 0
    assert "Traceback" not in srv.log_path.read_text()


@pytest.fixture(scope="session")
def guarded_server(tiny_dir, tmp_path_factory):
    """API key, a 4 KiB body limit, one running sequence and a waiting bound of one."""
    srv = LiveServer(tiny_dir, "--api-key", "sekret", "--max-request-body-bytes", "4096",
                     "--max-num-seqs", "1", "--max-waiting-requests", "1",
                     log_path=tmp_path_factory.mktemp("logs") / "guarded.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def scripted_server(tiny_dir):
    srv = InProcessServer(tiny_dir, reasoning_parser="minimax_m3", tool_call_parser="minimax_m3",
                          enable_auto_tool_choice=True)
    yield srv
    srv.stop()
