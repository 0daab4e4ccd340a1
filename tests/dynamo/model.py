#!/usr/bin/env python3
"""Builds the tiny model directory and the response-replay trace for tests/dynamo/run.sh.

  model.py DIR

Dynamo's mocker needs a tokenizer and a model config, not weights. This trains a byte-level BPE
of a few hundred tokens on a few sentences with the `tokenizers` library (in Dynamo's venv), and
writes:
  DIR/model/tokenizer.json, tokenizer_config.json (chat template, eos token), config.json
      (model_type qwen2), generation_config.json
  DIR/replay.jsonl  one Mooncake trace row per reply in REPLIES, with `request_id` and
      `output_token_ids`: the mocker streams those tokens to a request whose
      nvext.annotations hold `output_replay_id:<request_id>`
  DIR/replies.json  {request_id: the text the tokens decode to}, what the clients expect
Deterministic: the same input gives the same files.
"""

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# What the tokenizer is trained on, and the replies the mocker streams back.
CORPUS = [
    "The sidecar removes router annotations from event streams.",
    "Dynamo prepends a bypass marker when it skips remote prefill.",
    "Clients that did not ask for an annotation never see it.",
    "Hello from the real Dynamo frontend, through the proxy.",
    "Streaming chat and completions work with every SDK.",
    "Named events of the Responses API pass byte for byte.",
    "Anthropic message events reach the SDK untouched.",
]
REPLIES = {
    "chat": "Hello from the real Dynamo frontend, through the proxy.",
    "completion": "The sidecar removes router annotations from event streams.",
    "responses": "Named events of the Responses API pass byte for byte.",
    "messages": "Anthropic message events reach the SDK untouched.",
}
EOS = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}"
    "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def main():
    out = Path(sys.argv[1])
    model = out / "model"
    model.mkdir(parents=True, exist_ok=True)

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    tokenizer.save(str(model / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size()
    eos_id = tokenizer.token_to_id(EOS)

    (model / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": EOS,
                "bos_token": None,
                "pad_token": EOS,
                "model_max_length": 32768,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    (model / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen2ForCausalLM"],
                "model_type": "qwen2",
                "vocab_size": vocab,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "max_position_embeddings": 32768,
                "eos_token_id": eos_id,
                "bos_token_id": eos_id,
                "torch_dtype": "bfloat16",
            },
            indent=2,
        )
    )
    (model / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos_id, "bos_token_id": eos_id}, indent=2)
    )

    rows, replies = [], {}
    for request_id, text in REPLIES.items():
        ids = tokenizer.encode(text).ids
        decoded = tokenizer.decode(ids)
        if decoded != text:
            sys.exit(f"model.py: {text!r} decodes back to {decoded!r}")
        rows.append(
            {
                "timestamp": 0,
                "request_id": request_id,
                "input_length": 16,
                "output_length": len(ids),
                "hash_ids": [len(rows)],
                "output_token_ids": ids,
            }
        )
        replies[request_id] = text
    (out / "replay.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "replies.json").write_text(json.dumps(replies, indent=2))
    print(f"model.py: {vocab} tokens, eos {eos_id}, replies {sorted(replies)}")


if __name__ == "__main__":
    main()
