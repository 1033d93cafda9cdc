"""Every runnable example in the docs runs as the page writes it, through the command the page
gives, so a page cannot drift from the code. An HTML comment right before a fenced block (invisible
in the built site) says what the block is and how it runs:

    <!-- test: file NAME -->              written as NAME into the page's folder (a config, a module)
    <!-- test: commands -->               each `paratrain ...` command of the block runs there, exit 0
    <!-- test: commands skip=N why=".." -->  all but the block's Nth command
    <!-- test: commands as=plan why=".." -->  each `paratrain run` of the block goes through
                                          `paratrain plan` with the same arguments instead
    <!-- test: skip why="..." -->         looks runnable but cannot run here (a GPU, a cluster, ...)
    <!-- test: tested-by tests/X.py -->   run by that test module, which names the page

`needs=A,B` names what the test provides beside the page's own files (`PROVIDED`). A page's files
are written first, then its commands run in the page's order in one folder, as a reader would type
them. A block that looks runnable (a TOML job with [model] and [data], Python that calls
`paratrain.init`, a shell block of `paratrain` commands) must carry a marker, so a new page cannot
leave its examples unrun."""

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers import ROOT, check_ok, run_cli

from paratrain.cli import main

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# a fenced block, with the marker comment right before it where there is one (a blank line
# between them keeps Python-Markdown from reading the block as part of the comment's HTML)
BLOCK = re.compile(
    r"(?:^<!-- test: (?P<marker>.*?) -->\n\n?)?^(?P<indent> *)```(?P<lang>\w*)\n(?P<body>.*?)^(?P=indent)```",
    re.S | re.M,
)
KINDS = {"file", "commands", "skip", "tested-by"}
# a command line a reader could type, shown bare or after a prompt; a line with ` [` is a synopsis
# (`paratrain run [CONFIG.toml] [--nproc N]`), not a command
COMMAND = re.compile(r"^(?:\$ )?paratrain (?!.* \[).*$", re.M)

# A docs job trains for hundreds of steps; two show that it starts, steps, checkpoints and exports
# (what the steps compute is tested against plain PyTorch elsewhere).
SHORTER = ["--set", "train.steps=2"]


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    body: str
    kind: str | None
    argument: str | None = None
    options: dict[str, str] = field(default_factory=dict)

    @property
    def needs(self) -> list[str]:
        return [name for name in self.options.get("needs", "").split(",") if name]

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for match in BLOCK.finditer(text):
        words = shlex.split(match["marker"] or "")
        kind = words[0] if words else None
        argument = next((w for w in words[1:] if "=" not in w), None)
        options = dict(w.split("=", 1) for w in words[1:] if "=" in w)
        line = text.count("\n", 0, match.start("indent")) + 1
        found.append(Block(page, line, match["lang"], match["body"], kind, argument, options))
    return found


def looks_runnable(block: Block) -> bool:
    if block.lang == "toml":
        return bool(re.search(r"^\[model\]", block.body, re.M) and re.search(r"^\[data\]", block.body, re.M))
    if block.lang in ("bash", ""):
        return bool(COMMAND.search(block.body))
    return block.lang == "python" and "paratrain.init(" in block.body


def commands(block: Block) -> list[list[str]]:
    """The block's commands to run, as argument lists: the lines after `$ ` where the block shows
    output too, else every line, but the one its marker skips; a trailing backslash continues a
    line, `#` starts a comment."""
    lines = block.body.replace("\\\n", " ").splitlines()
    if any(line.startswith("$ ") for line in lines):
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    found = [words for words in (shlex.split(line, comments=True) for line in lines) if words]
    skipped = int(block.options.get("skip", 0))
    return [words for n, words in enumerate(found, 1) if n != skipped]


def _llama_start(folder: Path) -> None:
    from test_finetune import save_pretrained

    save_pretrained("llama", folder / "llama-start")


def _my_data(folder: Path) -> None:
    # the page's `my_data` module, the reader's data: the tests' prompt completions, whose token
    # ids fit the tiny Llama's vocabulary (tests/ put on the path by the module itself, which the
    # workers import from the page's folder)
    (folder / "my_data.py").write_text(
        f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from user_models import prompt_completions  # noqa: F401\n"
    )


def _notes(folder: Path) -> None:
    (folder / "notes").mkdir()
    for page in PAGES:  # text the reader might have: these pages
        (folder / "notes" / page.name).write_text(page.read_text())


def _job(folder: Path) -> None:
    """The `job.toml` a page's one-line command stands for: README's."""
    (readme,) = (b for b in blocks(ROOT / "README.md") if b.kind == "file" and b.argument == "job.toml")
    (folder / "job.toml").write_text(readme.body)


# what a page leaves to the reader, provided here: name -> writes it into the page's folder
PROVIDED = {"llama-start": _llama_start, "my_data.py": _my_data, "notes": _notes, "job.toml": _job}

ALL = [block for page in PAGES for block in blocks(page)]
RUNNABLE_PAGES = sorted({b.page for b in ALL if b.kind in ("file", "commands")})


def test_a_block_that_looks_runnable_carries_a_marker():
    unmarked = [str(b) for b in ALL if looks_runnable(b) and b.kind is None]
    assert not unmarked, f"runnable-looking blocks without a `<!-- test: ... -->` marker: {unmarked}"


def test_a_new_pages_unmarked_job_is_caught_and_a_marked_one_read(tmp_path):
    job = '```toml\n[model]\nfactory = "mlp"\n[data]\nfactory = "digits"\n```\n'
    page = tmp_path / "new.md"
    page.write_text(f"{job}\n<!-- test: file job.toml -->\n\n{job}")
    unmarked, marked = blocks(page)
    assert looks_runnable(unmarked) and unmarked.kind is None
    assert (marked.kind, marked.argument, marked.body) == ("file", "job.toml", unmarked.body)


def test_the_markers_say_what_they_mean():
    for block in (b for b in ALL if b.kind is not None):
        assert block.kind in KINDS, f"{block}: unknown marker {block.kind!r}"
        assert block.kind not in ("file", "tested-by") or block.argument, f"{block}: {block.kind} needs a name"
        assert block.kind != "skip" or block.options.get("why"), f"{block}: a skip says why"
        assert not {"as", "skip"} & set(block.options) or block.options.get("why"), f"{block}: says why"
        assert set(block.needs) <= set(PROVIDED), f"{block}: needs what the test does not provide: {block.needs}"
        if block.kind == "tested-by":
            assert block.page.name in (ROOT / block.argument).read_text(), f"{block}: {block.argument} names no page"
        if block.kind == "commands":
            assert all(words[0] == "paratrain" for words in commands(block)), f"{block}: not paratrain commands"


# Commands that start no worker run in this process, as their own tests run them, sparing each of
# the pages' dozen plans and job files a fresh interpreter's imports (seconds each on two cores).
IN_PROCESS = {"plan", "job"}


def run_command(command: str, args: list[str], folder: Path, monkeypatch) -> None:
    if command in IN_PROCESS:
        monkeypatch.chdir(folder)
        assert main([command, *args]) == 0, f"paratrain {command} {shlex.join(args)}"
    else:
        check_ok(run_cli(command, *args, cwd=folder))


@pytest.mark.parametrize("page", RUNNABLE_PAGES, ids=lambda page: page.name)
def test_the_page_runs_as_written(tmp_path, monkeypatch, page):
    marked = [b for b in ALL if b.page == page]
    for block in marked:
        for needed in block.needs:
            PROVIDED[needed](tmp_path)
        if block.kind == "file":
            (tmp_path / block.argument).write_text(block.body)
    for block in (b for b in marked if b.kind == "commands"):
        for _, command, *args in commands(block):
            if command == "run":
                command = block.options.get("as", "run")
                args += SHORTER if command == "run" else []
            run_command(command, args, tmp_path, monkeypatch)
