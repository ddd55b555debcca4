"""P/D fixtures: a KV producer and a KV consumer (`m3serve serve` on the tiny model, behind an
API key), started once for the whole session and checked for leaks at the end; the helpers
live in pdutil.py."""
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))

from pdutil import assert_clean, pd_flags  # noqa: E402
from serverutil import LiveServer  # noqa: E402

try:
    from m3serve.disagg.nixl_worker import nixl_api
    nixl_api()
except ImportError as e:
    if os.environ.get("M3SERVE_REQUIRE_TEST_DEPS") == "1":      # set by .ci/run: run or fail
        raise
    pytest.skip(f"P/D tests need NIXL (pip install nixl): {e}", allow_module_level=True)


@pytest.fixture(scope="session")
def pd(tiny_dir, tmp_path_factory):
    """{"P": producer (holds for at most 4 s), "D": consumer}."""
    servers = LiveServer.start_many(tiny_dir, {
        "P": pd_flags("kv_producer", abort_request_timeout=4),
        "D": pd_flags("kv_consumer"),
    }, tmp_path_factory.mktemp("pd-logs"))
    yield servers
    try:
        for srv in servers.values():
            assert_clean(srv)
    finally:
        for srv in servers.values():
            srv.stop()
    for srv in servers.values():
        assert "Traceback" not in srv.log_path.read_text(), srv.log_path.read_text()[-3000:]
