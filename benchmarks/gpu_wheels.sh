#!/usr/bin/env bash
# The wheels that `gpt2x serve` and `gpt2x loadtest` import at run time and the GPU machine's image lacks, for
# CPython 3.12 on manylinux x86_64, downloaded here (where pip reaches the index) into one folder that a device call
# carries:
#
#   bash benchmarks/gpu_wheels.sh [DIR]        # DIR: default .whl, relative to the repository's root
#
# then, in the device call (carry: [".whl"]), before `gpt2x serve` (a folder of their own, not the CUDA bundle's
# /tmp/site, and before it on the path):
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/serve-site \
#       .whl/*.whl && export PYTHONPATH=/tmp/serve-site${PYTHONPATH:+:$PYTHONPATH}
#
# The image (/work/.library/device/KINDS.md, "Python packages already there") has httpx, typer, rich, jinja2,
# prometheus-client, uvloop, h11, anyio, click, annotated-doc, xxhash, tiktoken, onnx, numpy, ..., but not the serve
# extra's FastAPI and uvicorn, nor what they need. One version of each (two stop the whole install), pinned to the
# versions the project's venv runs. Left out on purpose:
#   - llguidance and jsonschema (the structured extra): imported only when a request asks for structured output
#     (generation/constraints.py, lazily); the load test sends none.
#   - uvicorn[standard]'s websockets, watchfiles and python-dotenv: the server takes no websocket, reload or env file;
#     uvloop and PyYAML are in the image. httptools (uvicorn's faster HTTP parser, which the serve extra installs) is
#     carried, so that the server parses HTTP as it does here; nothing requires it (0.55 MB): where the device call
#     is short of room, delete .whl/httptools-*.whl and uvicorn parses with h11, which the image has.
# Every wheel's Requires-Dist (markers evaluated for CPython 3.12 on Linux x86_64, extras skipped) is checked: each
# requirement must be met by a wheel in DIR or named in the image's list; the script stops otherwise.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
dir=${1:-.whl}
python=${PYTHON:-}
if [ -z "$python" ]; then
    if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi
kinds=${GPT2X_DEVICE_KINDS:-/work/.library/device/KINDS.md}
limit_mb=36  # a device call carries 64 MiB in all; the working tree is about 24 MB of it

# The serve extra (pyproject.toml) less what the image holds, and their requirements that it lacks.
pins=(
    fastapi==0.165.0           # serve/openai/routes.py, many.py
    starlette==1.10.0          # fastapi's; routes.py imports starlette.exceptions
    pydantic==2.14.4           # serve/openai/*/protocol.py
    pydantic-core==2.50.5      # pydantic's (exactly this version); protocol.py imports pydantic_core
    annotated-types==0.8.0     # pydantic's
    typing-inspection==0.4.5   # pydantic's and fastapi's
    typing-extensions==4.16.0  # pydantic and pydantic-core need >= 4.16.0: the image's version is not known
    opentelemetry-api==1.45.2  # fastapi's: fastapi.applications imports fastapi.telemetry, which imports opentelemetry
    uvicorn==0.55.0            # serve/single_process.py
    httptools==0.9.0           # uvicorn's HTTP parser when installed (http="auto"), as the serve extra installs it
)

# .whl/ stays out of git (`git status` and the device call's working tree); idempotent.
exclude=$(git rev-parse --git-path info/exclude 2>/dev/null || true)
if [ -n "$exclude" ] && [ "$dir" = .whl ]; then
    mkdir -p "$(dirname "$exclude")"
    grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
fi

mkdir -p "$dir"
# Another version of a pinned package left in DIR by an earlier run: removed (two versions stop the install).
for pin in "${pins[@]}"; do
    name=${pin%%==*} version=${pin#*==}
    stem=$(echo "$name" | tr '-' '_')
    for f in "$dir/$stem"-*.whl; do
        [ -e "$f" ] || continue
        case $(basename "$f") in "$stem-$version-"*) ;; *) echo "removing $(basename "$f") (not $pin)"; rm -f "$f" ;; esac
    done
done

"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dir" "${pins[@]}" 2>&1 \
    | { grep -v "^WARNING: Location 'file:" || true; }

"$python" - "$dir" "$kinds" "$limit_mb" "${pins[@]}" <<'EOF'
import re, sys, zipfile
from email.parser import Parser
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # pip's own copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

folder, kinds, limit_mb, pins = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3]), sys.argv[4:]
env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "platform_system": "Linux",
       "platform_machine": "x86_64", "os_name": "posix", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "extra": ""}
wheels = {}  # name -> (version, path, requirements)
problems = []
for path in sorted(folder.glob("*.whl")):
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        msg = Parser().parsestr(z.read(meta).decode("utf-8"))
    name = canonicalize_name(msg["Name"])
    if name in wheels:
        problems.append(f"two wheels of {name}: {wheels[name][1].name} and {path.name} (keep one)")
    wheels[name] = (msg["Version"], path, msg.get_all("Requires-Dist") or [])
for pin in pins:
    name, version = pin.split("==")
    got = wheels.get(canonicalize_name(name))
    if got is None or got[0] != version:
        problems.append(f"{pin}: no such wheel in {folder}")
image = set()
if kinds.is_file():
    line = next((l for l in kinds.read_text().splitlines() if l.startswith("nvidia-h200:") and "Packages:" in l), "")
    image = {canonicalize_name(p.strip().rstrip(".")) for p in line.split("Packages:", 1)[-1].split(",") if p.strip()}
else:
    print(f"note: {kinds} not found: the requirements met by the image are not checked", file=sys.stderr)
from_image = {}
for name, (version, path, requires) in sorted(wheels.items()):
    for text in requires:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate(env):
            continue  # an extra's, or another Python's or platform's
        dep = canonicalize_name(req.name)
        if dep in wheels:
            if req.specifier and not req.specifier.contains(wheels[dep][0], prereleases=True):
                problems.append(f"{name} {version} needs {req}, the wheel is {dep} {wheels[dep][0]}")
        elif dep in image:
            from_image.setdefault(dep, []).append(f"{name}: {req}")
        elif image:
            problems.append(f"{name} {version} needs {req}: neither a wheel here nor in the image")
        else:
            from_image.setdefault(dep, []).append(f"{name}: {req} (unchecked)")
total = 0
for name, (version, path, _) in sorted(wheels.items()):
    size = path.stat().st_size
    total += size
    print(f"{size / 1e6:8.2f} MB  {path.name}")
print(f"{total / 1e6:8.2f} MB  in all, {len(wheels)} wheels in {folder}")
for dep, who in sorted(from_image.items()):
    print(f"from the image: {dep} ({'; '.join(who)})")
if total > limit_mb * 1e6:
    problems.append(f"{total / 1e6:.1f} MB of wheels: over the {limit_mb:g} MB the device call leaves beside the working tree")
for p in problems:
    print("error:", p, file=sys.stderr)
sys.exit(1 if problems else 0)
EOF
