"""The release's version agrees everywhere: Cargo.toml, python/Cargo.toml,
python/pyproject.toml, Cargo.lock, the newest dated heading of
CHANGELOG.md, and (given) `ckpt --version` and `ckptstore.__version__`.

Run: python3 scripts/versions.py [--ckpt target/debug/ckpt] [--python VENV/bin/python]
"""

import argparse
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def package_version(toml: pathlib.Path) -> str:
    """The `version` of the [package] (or [project]) table."""
    table = None
    for line in toml.read_text().splitlines():
        header = re.fullmatch(r"\s*\[([^\]]+)\]\s*", line)
        if header:
            table = header.group(1)
            continue
        m = re.fullmatch(r'\s*version\s*=\s*"([^"]+)"\s*', line)
        if m and table in ("package", "project"):
            return m.group(1)
    raise SystemExit(f"versions: no package version in {toml}")


def lock_versions() -> dict:
    text = (ROOT / "Cargo.lock").read_text()
    found = {}
    for name, version in re.findall(r'\[\[package\]\]\nname = "([^"]+)"\nversion = "([^"]+)"', text):
        if name in ("ckptstore", "ckptstore-python"):
            found[f"Cargo.lock ({name})"] = version
    return found


def changelog_version() -> str:
    for line in (ROOT / "CHANGELOG.md").read_text().splitlines():
        m = re.fullmatch(r"## (\d+\.\d+\.\d+) \(\d{4}-\d{2}-\d{2}\)", line.strip())
        if m:
            return m.group(1)
    raise SystemExit("versions: CHANGELOG.md has no dated release heading (## X.Y.Z (YYYY-MM-DD))")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", help="a built ckpt binary, asked for --version")
    ap.add_argument("--python", help="a Python with the package installed")
    args = ap.parse_args()
    found = {
        "Cargo.toml": package_version(ROOT / "Cargo.toml"),
        "python/Cargo.toml": package_version(ROOT / "python" / "Cargo.toml"),
        "python/pyproject.toml": package_version(ROOT / "python" / "pyproject.toml"),
        "CHANGELOG.md": changelog_version(),
        **lock_versions(),
    }
    if args.ckpt:
        out = subprocess.run([args.ckpt, "--version"], capture_output=True, text=True, check=True)
        found["ckpt --version"] = out.stdout.split()[-1]
    if args.python:
        code = "import ckptstore; print(ckptstore.__version__)"
        out = subprocess.run([args.python, "-c", code], capture_output=True, text=True, check=True, cwd="/")
        found["ckptstore.__version__"] = out.stdout.strip()
    want = found["Cargo.toml"]
    wrong = {k: v for k, v in found.items() if v != want}
    for k, v in found.items():
        print(f"versions: {k}: {v}")
    if wrong:
        sys.exit(f"versions: these disagree with Cargo.toml ({want}): {wrong}")


if __name__ == "__main__":
    main()
