"""README.md's every ```python block, run as written, as a reader would run them.

A section of README.md (a ``## `` heading, with its ``###`` subsections) is run in order in
one namespace and one fresh working folder: its blocks may use what the blocks before them
defined and the files they wrote. Sections share nothing. After a block fails, a later block
of its section that stops on a name the failed block never defined skips, naming it.

A block skips, with the reason, when a module it needs is not installed: one it imports, the
framework it names with ``like="..."``, or one that a name it uses from an earlier block
needed there. PyTorch's blocks run in the main environment, the TensorFlow block in the
TensorFlow one (tests-tensorflow/test_readme_tensorflow.py). A block after the HTML comment
``<!-- readme-test: skip, needs a GPU -->`` runs only where a CUDA device is present.

What a section needs is provided as a reader would provide it: an S3 server on loopback
(``s3s-fs``, ``_servers.S3Server``) with the ``AWS_*`` variables pointing at it for a
section that uses ``s3://``; the environment ``torchrun`` gives one rank for a section that
calls ``init_process_group``.
"""

import ast
import importlib.util
import os
import re
import sys
from dataclasses import dataclass, field

import pytest
from _servers import S3Server, free_port, s3_binary_or_skip

import tensorferry as tf

README = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "README.md"))
GPU_MARKER = "<!-- readme-test: skip, needs a GPU -->"
_LIKE = re.compile(r"""like=["'](torch|jax|tensorflow)["']""")


@dataclass
class Block:
    section: str
    line: int  # of the block's first line of code in README.md
    code: str
    needs_gpu: bool
    needs: set = field(default_factory=set)  # top-level modules, this block's and inherited

    @property
    def id(self):
        return f"{self.section}:{self.line}"


def _blocks(text):
    """Every ```python block of ``text``, with its section and what it needs."""
    blocks, section, fence, marker, body, start = [], "(top)", None, False, [], 0
    for number, line in enumerate(text.splitlines(), 1):
        if fence is None:
            if line.startswith("## "):
                section = line[3:].strip()
            elif line.strip() == GPU_MARKER:
                marker = True
            elif line.startswith("```"):
                fence = line[3:].strip().split(" ")[0]
                body, start = [], number + 1
            elif line.strip():
                marker = False
        elif line.startswith("```"):
            if fence == "python":
                blocks.append(Block(section, start, "\n".join(body) + "\n", marker))
            fence, marker = None, False
        else:
            body.append(line)
    _resolve_needs(blocks)
    return blocks


def _resolve_needs(blocks):
    """Each block needs the modules it imports, the frameworks its ``like=`` names, and what
    the names it uses from earlier blocks of its section needed where they were defined."""
    needs_of_name = {}  # (section, name) -> what its latest definition needed
    for block in blocks:
        tree = ast.parse("\n" * (block.line - 1) + block.code, filename=README)
        needs = set(_LIKE.findall(block.code))
        imported = {}  # a name an import binds -> the module it needs
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    module = alias.name.split(".")[0]
                    imported[alias.asname or module] = module
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    imported[alias.asname or alias.name] = node.module.split(".")[0]
        needs.update(imported.values())
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                needs |= needs_of_name.get((block.section, node.id), set())
        block.needs = needs
        # A name an import binds needs its module; any other name, what its block needed.
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names = [node.id]
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            for name in names:
                needs_of_name[(block.section, name)] = needs
        for name, module in imported.items():
            needs_of_name[(block.section, name)] = {module}


with open(README, encoding="utf-8") as f:
    BLOCKS = _blocks(f.read())


def _missing(needs):
    return sorted(m for m in needs if importlib.util.find_spec(m) is None)


def _has_gpu():
    return any(d.startswith("cuda") for d in tf.devices())


class SectionRun:
    """One section's namespace, working folder and environment, undone by ``close``."""

    def __init__(self, name, folder, blocks):
        self.name = name
        self.folder = folder
        self.namespace = {"__name__": "__readme__"}
        self.failed_at = None
        self._saved_env = {}
        self._server = None
        code = "".join(b.code for b in blocks)
        if "s3://" in code:
            self._start_s3()
        if "init_process_group" in code:
            self._setenv(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                         LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        self._setenv(JAX_PLATFORMS="cpu")

    def _setenv(self, **values):
        for key, value in values.items():
            self._saved_env.setdefault(key, os.environ.get(key))
            os.environ[key] = value

    def _start_s3(self):
        # The object-storage tests' server and credentials, one server per section; without
        # the server, each block of the section skips (or fails under TENSORFERRY_REQUIRE_S3).
        self._server = S3Server(s3_binary_or_skip(), os.path.join(self.folder, ".s3"))
        self._setenv(**self._server.environment())

    def run(self, block):
        before = os.getcwd()
        os.chdir(self.folder)
        try:
            # Compiled as README.md itself, lines in place: tracebacks name README's lines.
            code = "\n" * (block.line - 1) + block.code
            exec(compile(code, README, "exec"), self.namespace)
        finally:
            os.chdir(before)

    def close(self):
        if "torch" in sys.modules:
            dist = sys.modules["torch"].distributed
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
        if self._server is not None:
            self._server.stop()
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        # Fault injection a snippet configured must not reach the tests that follow.
        for index in (0, 1):
            tf.configure_emulated(index)


@pytest.fixture(scope="module")
def sections(tmp_path_factory):
    """The section being run (one at a time, in README order)."""
    current = {}
    yield current
    if current:
        current.pop("run").close()


def test_readme_has_python_blocks_in_the_sections_a_user_looks_for():
    names = {b.section for b in BLOCKS}
    assert {"Quickstart", "Frameworks", "Checkpoints", "Devices and asynchronous moves"} <= names, names


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_readme_snippet_runs(block, sections, tmp_path_factory):
    run_block(block, sections, tmp_path_factory)


def run_block(block, sections, tmp_path_factory):
    """Runs ``block`` in its section's run (starting that run, and closing the previous
    one, when ``block`` is the first of its section), or skips it with the reason."""
    run = sections.get("run")
    if run is None or run.name != block.section:
        if run is not None:
            sections.pop("run").close()
        mine = [b for b in BLOCKS if b.section == block.section]
        run = sections["run"] = SectionRun(block.section, str(tmp_path_factory.mktemp("readme")), mine)
    if block.needs_gpu and not _has_gpu():
        pytest.skip("needs a GPU")
    missing = _missing(block.needs)
    if missing:
        pytest.skip(f"needs {', '.join(missing)}, not installed")
    try:
        run.run(block)
    except NameError as e:
        if run.failed_at is None:
            run.failed_at = block.line
            raise
        # Not this block's failure: an earlier block of its section failed before defining it.
        pytest.skip(f"{e}: the block at README.md:{run.failed_at} failed before defining it")
    except BaseException:
        run.failed_at = run.failed_at or block.line
        raise
