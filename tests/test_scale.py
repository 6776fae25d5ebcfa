"""The course at scale: the chapters' GPU arithmetic rests on the one table of hardware
figures and the one node-aware model of communication, and states no GPU outcome that no
run measured. Checks on the chapters' source (cheap: nothing is executed here).
"""

import re
from pathlib import Path

import pytest

from shardlab import hardware

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "chapters").glob("*.md"))


def chapter(prefix: str) -> str:
    return next(p for p in CHAPTERS if p.name.startswith(prefix)).read_text()


def code_cells(text: str) -> str:
    return "\n".join(re.findall(r"```\{code-cell\}[^\n]*\n(.*?)```", text, re.S))


def flat(text: str) -> str:
    return " ".join(text.split())


# ---------------------------------------------------------------- 1: bandwidth per node

def test_no_chapter_defines_its_own_tokens_to_hide():
    for path in CHAPTERS:
        assert "def tokens_to_hide" not in path.read_text(), path.name


@pytest.mark.parametrize("prefix", ["01", "03", "04", "05", "07"])
def test_the_chapters_that_time_collectives_on_gpus_use_the_shared_model(prefix):
    code = code_cells(chapter(prefix))
    assert re.search(r"from shardlab import [^\n]*\bnetwork\b", code), prefix
    assert "network.collective_seconds_on_cluster" in code or "network.tokens_to_hide" in code \
        or "network.bytes_leaving_node" in code


def test_no_cross_node_time_divides_by_one_nic():
    """The old premise: a GPU's whole ring traffic over its own 50 GB/s NIC (`/ IB`)."""
    for path in CHAPTERS:
        code = code_cells(path.read_text())
        assert not re.search(r"/ ?\(?\s*(IB|IB_BPS|P_IB)\b", code), path.name


# ---------------------------------------------- 2: tensor parallelism against its share

def test_tensor_parallel_traffic_is_weighed_against_a_gpus_share_of_the_layer():
    text = chapter("07")
    assert "layer_compute = 6 * c.layer_params() * SEQ / PEAK" not in text
    assert re.search(r"layer_compute = 6 \* c\.layer_params\(\) \* SEQ / \(DEG \* PEAK\)", text)
    assert "async tensor parallelism" in flat(text).lower()


# ------------------------------------------------------------------ 3: ZeRO-Infinity

def test_zero_infinitys_example_does_not_fit_in_hbm_and_counts_the_write_back():
    """ZeRO-Infinity's arithmetic is chapter 15's, beside its run (chapter 7 points there)."""
    assert "far beyond their GPU memory" not in chapter("07") + chapter("15")
    code = code_cells(chapter("15"))
    n = int(re.search(r"PSI_1T, N_NODE, TOKENS = 10\*\*12, (\d+),", code).group(1))
    assert 16 * 10**12 / n > hardware.H100_MEMORY   # the example needs NVMe
    # the optimizer's I/O is exposed, and the updated shard is written back every step
    assert 'EXPOSED = bf16["step read"] + bf16["step written"]' in code


# ------------------------------------------------------------- 4: the unit's gradient

def test_the_gathered_term_counts_the_units_gradient():
    # q: bytes per element (the notation page)
    assert r"q\,(2\,\Psi_\text{unit} + \Psi_\text{next})" in chapter("07")
    ch5 = flat(chapter("05"))
    assert "which no GPU of {glue:text}`p2_hbm` can hold beside anything else" not in ch5
    assert "memory.gathered_bytes" in code_cells(chapter("05"))


# --------------------------------------------------------------------- 5: allocator

def test_the_allocator_section_says_how_reserved_memory_shrinks():
    text = flat(chapter("08"))
    assert "reserved only grows" not in text
    assert "num_alloc_retries" in text and "torch.cuda.empty_cache()" in text
    # the message quoted as PyTorch writes it, not paraphrased
    assert "Including non-PyTorch memory, this process has P memory in use." in text
    assert "is reserved by PyTorch but unallocated. If reserved but unallocated" in text


# ---------------------------------------------------------------------- 6: glossary

def glossary() -> dict[str, str]:
    """term -> definition, from the glossary's ```{glossary} blocks."""
    out: dict[str, str] = {}
    for block in re.findall(r"```\{glossary\}\n(.*?)```", (ROOT / "glossary.md").read_text(),
                            re.S):
        terms: list[str] = []
        for line in block.splitlines():
            if line and not line.startswith(" "):
                if terms and out.get(terms[-1]):
                    terms = []
                terms.append(line.strip())
                out[line.strip()] = ""
            elif line.strip():
                for t in terms:
                    out[t] += " " + line.strip()
    return out


def test_the_glossary_defines_what_the_chapters_use():
    g = glossary()
    for term in ("DTensor", "DeviceMesh", "DCP", "exposed communication", "straggler",
                 "pipeline bubble", "MFU"):
        assert g.get(term), term


def test_the_glossary_says_what_its_terms_do_not_do():
    g = glossary()
    assert "sequence parallelism" in g["tensor parallelism"]
    assert "math backend" in g["SDPA"] and g["SDPA"] != g["FlashAttention"]
    assert "DeepSpeed" in g["flat buffer"]
    assert "gradients" in g["ZeRO-Offload"]


# --------------------------------------------------------------- 7: one table of figures

# a literal like 450e9, 989e12, 2e9 or 80 * GB in a chapter's code is a hardware figure
# typed there instead of read from `shardlab.hardware` (1e9 and 1e12 are units)
FIGURE_LITERAL = re.compile(r"(?<![\w.])(?!1e)\d+(\.\d+)?e(9|12|-6)\b|\b\d+ \* GB\b")


def test_every_hardware_figure_in_the_chapters_comes_from_the_table():
    for path in CHAPTERS:
        found = [m.group(0) for m in FIGURE_LITERAL.finditer(code_cells(path.read_text()))]
        assert not found, f"{path.name}: {found}"


def test_the_checker_sees_a_typed_figure():
    assert FIGURE_LITERAL.search("NVLINK, IB = 450e9, 50e9")
    assert FIGURE_LITERAL.search("GPU = 80 * GB")
    assert FIGURE_LITERAL.search("ALPHA = 5e-6")
    assert not FIGURE_LITERAL.search("x / 1e9, y / 1e12, 10**9, atol=1e-6")


# ------------------------------------------------------------------ 8: GPU outcomes

@pytest.mark.parametrize("prefix, claim", [
    ("05", "the measured curve follows the dotted one"),
    ("08", "a healthy ZeRO-3 step shows most of its all-gathers hidden"),
    ("04", "bucketed collectives do hide behind backward"),
    ("01", "much of ZeRO-3's extra traffic hides behind the forward and backward passes"),
    ("08", "is what the overlap removes"),
])
def test_no_gpu_outcome_is_stated_without_a_run(prefix, claim):
    assert claim not in flat(chapter(prefix))
