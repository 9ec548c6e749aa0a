#!/usr/bin/env python3
"""Regenerates crates/lab/tokenizers/bpe-4k: a small byte-level BPE tokenizer shaped like
Llama 3's (byte-level pre-tokenizer, a BOS token added to plain prompts, header and
end-of-turn special tokens, a chat template in tokenizer_config.json), trained on this
repository's own English text. The lab's simulator and kvroute's local tokenizer both
load it, so tests and benchmarks exercise a real `tokenizer.json` without downloading
a model. Needs `pip install tokenizers`; the output is committed, CI does not run this.

    python3 scripts/make-test-tokenizer.py
"""

import json
import pathlib

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "crates/lab/tokenizers/bpe-4k"
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]

# A Llama-3-style template: a header per message, content trimmed, the turn closed by
# <|eot_id|>, and the assistant's header as the generation prompt.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{- raise_exception('Unknown role: ' + message['role']) }}"
    "{%- endif %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] | trim }}"
    "{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)


# The lab's prompt words (crates/lab/src/loadgen/workload/generator.rs, WORDS), each one
# token in the simulator's synthetic tokenizer: repeated in the corpus so that each is one
# token here too, and the workloads' token counts (their KV budgets) hold with this one.
LAB_WORDS = (
    " the and for not are but can one all any new now old see two way who boy did its let"
    " put say she too use day get has him his how man our out own run set sun red big box"
    " car cat dog eat far fun hot job key law low map net oil pay sea sit top war yes of to"
)


def corpus():
    for path in sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")]):
        yield path.read_text(encoding="utf-8")
    for _ in range(200):
        yield LAB_WORDS


def main():
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4096,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer)
    bos = tokenizer.token_to_id("<|begin_of_text|>")
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single="<|begin_of_text|> $A",
            pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", bos)],
        ),
    ])
    OUT.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(OUT / "tokenizer.json"))
    config = {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
    }
    (OUT / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":
    main()
