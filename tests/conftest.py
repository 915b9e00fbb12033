"""Shared fixtures: a private redis-server per test on a free port (never the one on 6379)."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# DeepSpeed JIT-compiles small CPU ops once; keep them in one cached folder.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".torch_extensions"))
# models made on the spot are cached under $XDG_CACHE_HOME (worldloop/bootstrap/store.py): the tests'
# (and their child processes') go to a folder of this session, never to the user's cache
_CACHE = tempfile.mkdtemp(prefix="worldloop-test-cache-")
os.environ["XDG_CACHE_HOME"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, True)

from worldloop.common.transport.redis_local import LocalRedis  # noqa: E402


@pytest.fixture
def redis_server():
    """A fresh redis-server on a free loopback port; yields the LocalRedis (url, restart(), stop())."""
    srv = LocalRedis().start()
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture
def redis_url(redis_server) -> str:
    return redis_server.url
