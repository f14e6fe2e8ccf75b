"""Generate the Python gRPC code for every .proto under protos/ (next to the .proto files).

    python scripts/gen_protos.py           # regenerate in place
    python scripts/gen_protos.py --check   # fail if the committed code is stale (CI)

The generated files are committed so that installing kvbridge needs no code generator; the
check keeps them equal to what the pinned grpcio-tools and mypy-protobuf produce.
"""

from __future__ import annotations

import argparse
import filecmp
import importlib.resources
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def generate(out: Path) -> None:
    protos = sorted(p.relative_to(PROTOS).as_posix() for p in PROTOS.rglob("*.proto"))
    well_known = importlib.resources.files("grpc_tools") / "_proto"
    cmd = [
        sys.executable, "-m", "grpc_tools.protoc",
        f"-I{PROTOS}", f"-I{well_known}",
        f"--python_out={out}", f"--grpc_python_out={out}",
        f"--mypy_out={out}", f"--mypy_grpc_out={out}",
        *protos,
    ]
    subprocess.run(cmd, check=True, cwd=PROTOS)


def generated_files(root: Path) -> set[str]:
    return {
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and p.name.endswith(GENERATED_SUFFIXES)
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if generated code is stale")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        generate(out)
        fresh, committed = generated_files(out), generated_files(PROTOS)
        if args.check:
            stale = sorted(
                name for name in fresh | committed
                if name not in fresh or name not in committed
                or not filecmp.cmp(out / name, PROTOS / name, shallow=False)
            )
            if stale:
                print("generated code is stale; run: python scripts/gen_protos.py", file=sys.stderr)
                for name in stale:
                    print(f"  {name}", file=sys.stderr)
                return 1
            print(f"generated code up to date ({len(fresh)} files)")
            return 0
        for name in committed - fresh:
            (PROTOS / name).unlink()
        for name in sorted(fresh):
            shutil.copyfile(out / name, PROTOS / name)
            print(f"wrote protos/{name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
