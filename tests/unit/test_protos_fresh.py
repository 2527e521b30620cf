"""The generated code in src/amprl/v1 is what `make protos` produces from protos/ now."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_not_stale(tmp_path):
    protos = sorted((ROOT / "protos/amprl/v1").glob("*.proto"))
    assert protos
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'protos'}",
                    f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}",
                    f"--mypy_out={tmp_path}", f"--mypy_grpc_out={tmp_path}", *map(str, protos)],
                   check=True, env=env, capture_output=True)
    generated = sorted(p.name for p in (tmp_path / "amprl/v1").iterdir())
    committed = sorted(p.name for p in (ROOT / "src/amprl/v1").iterdir()
                       if p.name != "__init__.py" and p.suffix in (".py", ".pyi"))
    assert generated == committed
    stale = [name for name in generated
             if (tmp_path / "amprl/v1" / name).read_bytes() != (ROOT / "src/amprl/v1" / name).read_bytes()]
    assert not stale, f"stale generated code (run `make protos`): {stale}"


def test_every_proto_element_has_a_comment():
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        protos = sorted(str(p) for p in (ROOT / "protos/amprl/v1").glob("*.proto"))
        rc = protoc.main(["protoc", f"-I{ROOT / 'protos'}", f"-I{Path(protoc.__file__).parent / '_proto'}",
                          "--include_source_info", f"--descriptor_set_out={out}", *protos])
        assert rc == 0
        fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    missing = []
    for f in fds.file:
        commented = {tuple(loc.path) for loc in f.source_code_info.location if loc.leading_comments.strip()}

        def check(path, name):
            if tuple(path) not in commented:
                missing.append(f"{f.name}: {name}")

        for i, m in enumerate(f.message_type):
            check([4, i], m.name)
            for j, fld in enumerate(m.field):
                check([4, i, 2, j], f"{m.name}.{fld.name}")
        for i, e in enumerate(f.enum_type):
            check([5, i], e.name)
            for j, v in enumerate(e.value):
                check([5, i, 2, j], f"{e.name}.{v.name}")
        for i, s in enumerate(f.service):
            check([6, i], s.name)
            for j, meth in enumerate(s.method):
                check([6, i, 2, j], f"{s.name}.{meth.name}")
    assert not missing, f"uncommented proto elements: {missing}"
