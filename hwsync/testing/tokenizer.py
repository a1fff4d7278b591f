"""A tiny Qwen3-style fast tokenizer, built offline and deterministically.

Real Qwen3 / Qwen3.5 checkpoints ship a byte-level BPE with Qwen's pre-tokenizer (every digit is its own
token), ChatML special tokens and a Jinja chat template. The fixture reproduces that pipeline at a vocabulary
of a few hundred entries, so vLLM, transformers and ms-swift treat it exactly like the real tokenizer while
the embedding stays tiny. Nothing is downloaded: the BPE merges are learnt from a built-in corpus.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "VOCAB_SIZE",
    "build_tokenizer",
    "write_tokenizer",
]

#: Pre-tokenizer regexes of the real tokenizers (every digit is its own token). transformers rebuilds the
#: pipeline of Qwen2Tokenizer / Qwen3_5Tokenizer from these, so tokenizer.json must carry the same one.
PRETOKENIZE_REGEX: dict[str, str] = {
    "qwen3_moe": (
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa: E501 - the tokenizer's regex, verbatim
    ),
    "qwen3_5_moe": (
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa: E501 - the tokenizer's regex, verbatim
    ),
}

#: Added tokens in Qwen3's order, with Qwen3's ``special`` flags: the think / tool tags are *not* special,
#: so ``skip_special_tokens=True`` keeps them (reasoning and tool parsers rely on that).
SPECIAL_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

#: Total vocabulary (BPE + added tokens); a multiple of 64 like real checkpoints, so no padded logit rows.
VOCAB_SIZE = 512

# Text the merges are learnt from: chat-template scaffolding, arithmetic prompts/answers, common words.
_CORPUS = (
    "system\nuser\nassistant\ntool\nYou are a helpful assistant.\n",
    "What is 3+4? The answer is 7. What is 12-5? The answer is 7. What is 6*7? The answer is 42.",
    "What is 9/3? The answer is 3. Compute 15+27. 15+27=42. Solve: 8*8=64. The result is 100.",
    "Let me think step by step. First, add the numbers. Then, subtract. So the final answer is \\boxed{42}.",
    "Answer with a single number. Please reason step by step, and put your final answer within \\boxed{}.",
    "the of and to in is it that for on with as was be at by this are from or an not have you they we",
    "Hello, world! How are you today? I am fine, thank you. Yes. No. Okay. Sure. Correct. Wrong.",
    '{"name": "add", "arguments": {"a": 3, "b": 4}} function tools call response result',
    "plus minus times divided by equals sum difference product quotient number numbers digit digits",
)

# ChatML with Qwen3's conventions: tools in the system turn, reasoning inside <think></think>, history
# reasoning dropped, tool results wrapped as <tool_response> user turns, `enable_thinking=False` pre-fills an
# empty think block. Written for this fixture (token layout as Qwen3's template, logic condensed).
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_query=messages | length - 1, found=false) %}"
    "{%- for m in messages[::-1] %}"
    "{%- if m.role == 'user' and not ns.found %}"
    "{%- set ns.last_query = messages | length - 1 - loop.index0 %}{%- set ns.found = true %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- set content = message.content if message.content is string else '' %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}"
    "{%- if message.reasoning_content is not string and '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{{- content }}"
    "{%- for tc in message.tool_calls or [] %}"
    "{%- set fn = tc.function if tc.function is defined else tc %}"
    "{{- ('\\n' if (loop.first and content) or not loop.first else '') + '<tool_call>\\n{\"name\": \"' "
    '+ fn.name + \'", "arguments": \' + (fn.arguments if fn.arguments is string else fn.arguments | tojson) '
    "+ '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


def build_tokenizer(family: str = "qwen3_moe") -> Any:
    """Return a ``tokenizers.Tokenizer``: the byte-level BPE pipeline of ``family``'s real tokenizer,
    ``VOCAB_SIZE`` entries in total.

    Deterministic: the trainer sees a fixed corpus, and the result is checked to be byte-identical across
    processes in the tests.
    """
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX[family]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    base = tok.get_vocab_size()
    if base != VOCAB_SIZE - len(SPECIAL_TOKENS):  # the corpus must be rich enough to fill the BPE vocabulary
        raise RuntimeError(
            f"tiny tokenizer: BPE vocabulary has {base} entries, expected {VOCAB_SIZE - len(SPECIAL_TOKENS)}"
        )
    tok.add_tokens(
        [
            AddedToken(t, special=s, normalized=False, single_word=False, lstrip=False, rstrip=False)
            for t, s in SPECIAL_TOKENS
        ]
    )
    return tok


def token_id(name: str) -> int:
    """Id of an added token (they follow the BPE vocabulary in ``SPECIAL_TOKENS`` order)."""
    names = [t for t, _ in SPECIAL_TOKENS]
    return VOCAB_SIZE - len(SPECIAL_TOKENS) + names.index(name)


def write_tokenizer(path: Path, family: str, *, model_max_length: int) -> None:
    """Write ``tokenizer.json`` and a Qwen3-like ``tokenizer_config.json`` (chat template inline)."""
    tok = build_tokenizer(family)
    (path / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(token_id(t)): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": s,
            }
            for t, s in SPECIAL_TOKENS
        },
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (path / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
