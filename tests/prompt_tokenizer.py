"""A tiny local Hugging Face tokenizer directory for the prompt loader's tests: no hub, no download.

A word-level vocabulary (whitespace split, unknown words to ``<unk>``), a ``<s>`` added to plain text, and a
chat template that starts with ``<s>`` itself and ends, with ``add_generation_prompt``, on ``<|assistant|>``:
so text is tokenized with special tokens and a rendered chat without (``<s>`` once either way).
"""

from __future__ import annotations

from pathlib import Path

WORDS = ["<unk>", "<s>", "</s>", "<|user|>", "<|system|>", "<|assistant|>",
         "what", "is", "two", "plus", "three", "?", "you", "are", "a", "calculator", "."]
VOCAB = {word: index for index, word in enumerate(WORDS)}
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def make_tokenizer(directory: Path, *, chat_template: str | None = CHAT_TEMPLATE, add_bos: bool = True) -> Path:
    """Save the tiny tokenizer as a ``PreTrainedTokenizerFast`` directory at ``directory``; return it. Without
    ``add_bos`` plain text gets no ``<s>`` (so text of no words is no tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if add_bos:
        core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", VOCAB["<s>"])])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", additional_special_tokens=WORDS[3:6])
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(directory))
    return directory


def ids(text: str) -> list[int]:
    """The token ids of whitespace-separated words of the vocabulary."""
    return [VOCAB[word] for word in text.split()]
