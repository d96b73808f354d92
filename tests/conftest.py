import json
import os

import pytest
import torch

from blockdraft.draft import DFlashDrafter, DraftConfig
from blockdraft.models import load_target, load_tokenizer
from blockdraft.models.default import DEFAULT_MASK_TOKEN_ID, default_target_dir
from blockdraft.models.packed import pack_linears

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))

# Ten varied prompts: code, maths, chat, lists, translation, long and short.
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is 17 times 23? Explain step by step.",
    "Give me three tips for sleeping better.",
    "Translate 'good morning, my friend' into French and Spanish.",
    "Hi!",
    "Write a haiku about the sea.",
    "Explain what a hash table is to a ten-year-old.",
    "List the planets of the solar system in order from the sun.",
    "def quicksort(arr):",
    "Summarize the plot of Romeo and Juliet in two sentences, then name one theme of the play.",
]


@pytest.fixture(autouse=True, scope="module")
def _release_memory_after_each_module():
    """Hand the allocator's freed memory back to the system after each module (glibc keeps it for
    reuse otherwise: each module's models and buffers, freed, stayed in the worker's resident size)."""
    import ctypes
    import gc

    yield
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def computed_once(tmp_path_factory, name: str, compute):
    """`compute()` (JSON-serialisable) once per test run, shared by the pytest-xdist workers
    through a file in their common temporary folder (each worker alone would compute it)."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    path = root / f"{name}.json"
    with FileLock(str(path) + ".lock"):
        if not path.exists():
            path.write_text(json.dumps(compute()))
        return json.loads(path.read_text())


@pytest.fixture(scope="session")
def smol_dir():
    return default_target_dir()


@pytest.fixture(scope="session")
def smol(smol_dir):
    model = load_target(smol_dir)
    pack_linears(model)  # as Engine.load does: verify-sized products use prepacked weights
    return model


@pytest.fixture(scope="session")
def tokenizer(smol_dir):
    return load_tokenizer(smol_dir)


@pytest.fixture(scope="session")
def hf_smol(smol_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smol_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def random_drafter(smol):
    torch.manual_seed(1234)
    cfg = DraftConfig.for_target(smol.config, num_layers=2, block_size=16, mask_token_id=DEFAULT_MASK_TOKEN_ID)
    return DFlashDrafter(cfg).eval()


@pytest.fixture(scope="session")
def chat_ids(tokenizer):
    def encode(prompt):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return tokenizer(text, add_special_tokens=False).input_ids

    return [encode(p) for p in PROMPTS]


def drafter_with_markov_rank(folder, rank: int, out, *, seed: int = 7, scale: float = 0.3):
    """The DFlash drafter in `folder` with its Markov head replaced: none (`rank` 0), or a seeded
    random one of `rank` (entries N(0, scale^2), large enough to change drafts); saved to `out`,
    which is returned. The rest of the drafter's weights are kept."""
    source = DFlashDrafter.load(folder)
    drafter = DFlashDrafter(DraftConfig.from_dict({**source.config.to_dict(), "markov_rank": rank}))
    state = {k: v for k, v in source.state_dict().items() if not k.startswith("markov_head.")}
    generator = torch.Generator().manual_seed(seed)
    for name, p in drafter.state_dict().items():
        if name.startswith("markov_head."):
            state[name] = torch.randn(p.shape, generator=generator) * scale
    drafter.load_state_dict(state)
    drafter.save(out)
    return out


def save_tiny_hf(model_type: str, path, **overrides):
    """A tiny randomly initialised HF model of `model_type`, saved as safetensors."""
    import transformers

    cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mistral": transformers.MistralConfig,
    }[model_type]
    kw = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    if model_type == "qwen3":
        kw["head_dim"] = 16
    kw.update(overrides)
    config = cls(**kw)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # make norms non-trivial so a missing weight would show
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(path))
    return model


def read_json(path):
    return json.loads(open(path).read())
