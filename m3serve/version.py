"""The installed m3serve's version (`m3serve --version`, `GET /version`), without importing
anything heavy."""
from __future__ import annotations


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("m3serve")
    except PackageNotFoundError:
        return "0+unknown"
