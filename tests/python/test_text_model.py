"""The frontend's tokenization (kvtier-text: Hugging Face ``tokenizers`` and
``minijinja`` behind TextModel) against the engines' own, on 300 prompts
and 100 chats of every kind of text (prose, code, Unicode, whitespace,
special tokens written in the text, content parts):

- Hugging Face ``transformers`` (``AutoTokenizer``, ``apply_chat_template``)
  in process;
- vLLM's own ``/tokenize`` of a real ``vllm serve`` (the CPU build) with the
  tiny model and its tokenizer (tests/models/tiny-llama).

The frontend forwards ids, so an id that differs would make the engine
compute blocks other than those the router priced. Run with the project's
environment (tests/python/run_venv_pytest.sh); skipped, saying why, without.
"""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import BUILD, ROOT
from vllm_server import TINY_LLAMA, VllmServer

transformers = pytest.importorskip(
    "transformers", reason="transformers is in the project's environment (make venv)"
)

TEXT_BIN = BUILD / "frontend" / "kvtier-text"

UNICODE = [
    "naïve café déjà vu",
    "缓存分层与前缀路由",
    "キャッシュ",
    "🚀🔥✨ KV 🧠",
    "Привет, мир",
    "مرحبا بالعالم",
    "e\u0301 combining",
    "ﬁ ligature ß",
    "한국어 텍스트",
    "\u200b zero width",
    "Ελληνικά",
    "tab\there",
    "math: ∑ᵢ xᵢ² ≤ ∞",
]
SPACES = [
    "  leading",
    "trailing   ",
    "a\n\nb",
    "\t\tindent",
    "line\r\nbreak",
    "   ",
    "many     spaces",
    "\n",
    "x \n y",
]
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<unk>"]


def corpus() -> list[str]:
    """Paragraphs of the repository's docs and slices of its C++."""
    out: list[str] = []
    for f in sorted((ROOT / "docs").glob("*.md")):
        out += [p for p in f.read_text().split("\n\n") if p.strip()]
    for f in sorted((ROOT / "router").glob("*.cc"))[:6]:
        text = f.read_text()
        out += [text[i : i + 300] for i in range(0, min(len(text), 3000), 300)]
    return out


def prompts(rng: random.Random, n: int) -> list[str]:
    """``n`` prompts: prose cut anywhere, code, Unicode, whitespace, special
    tokens inside text, random code points, and mixtures of them."""
    pool = corpus()
    out: list[str] = []
    for i in range(n):
        kind = i % 6
        if kind == 0:
            p = rng.choice(pool)
            out.append(p[: rng.randint(1, len(p))])
        elif kind == 1:
            out.append(rng.choice(UNICODE) + " " + rng.choice(pool)[:80])
        elif kind == 2:
            out.append(rng.choice(SPACES) + rng.choice(pool)[:60] + rng.choice(SPACES))
        elif kind == 3:
            out.append(
                rng.choice(pool)[:50] + rng.choice(SPECIALS) + rng.choice(pool)[:50]
            )
        elif kind == 4:
            chars = [
                chr(
                    rng.choice(
                        [
                            rng.randint(0x20, 0x7E),
                            rng.randint(0xA0, 0xD7FF),
                            rng.randint(0xE000, 0xFFFD),
                            rng.randint(0x1F300, 0x1F6FF),
                        ]
                    )
                )
                for _ in range(rng.randint(1, 40))
            ]
            out.append("".join(chars))
        else:
            out.append(
                " ".join(rng.choice(pool)[:40] for _ in range(rng.randint(2, 5)))
            )
    return out


def chats(rng: random.Random, n: int) -> list[dict[str, Any]]:
    """``n`` chat requests: 1-5 messages, content as text or as text parts,
    with and without the generation prompt."""
    texts = prompts(rng, 200)
    out: list[dict[str, Any]] = []
    for _ in range(n):
        messages: list[dict[str, Any]] = []
        if rng.random() < 0.5:
            messages.append({"role": "system", "content": rng.choice(texts)})
        for turn in range(rng.randint(1, 4)):
            role = "user" if turn % 2 == 0 else "assistant"
            if rng.random() < 0.2:
                content: Any = [
                    {"type": "text", "text": rng.choice(texts)}
                    for _ in range(rng.randint(1, 3))
                ]
            else:
                content = rng.choice(texts)
            messages.append({"role": role, "content": content})
        out.append({"messages": messages, "add_generation_prompt": rng.random() < 0.8})
    return out


def flattened(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Content parts joined by newlines, as vLLM hands them to a template
    that takes content as a string (Hugging Face's own call does not)."""
    return [
        {**m, "content": "\n".join(p["text"] for p in m["content"])}
        if isinstance(m["content"], list)
        else m
        for m in messages
    ]


def frontend_ids(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """kvtier-text's answers, one per request, from one process."""
    if not TEXT_BIN.exists():
        pytest.fail(f"{TEXT_BIN} is not built (cmake --build build)")
    lines = "".join(json.dumps(r) + "\n" for r in requests)
    done = subprocess.run(
        [str(TEXT_BIN), f"--model={TINY_LLAMA}"],
        input=lines.encode(),
        capture_output=True,
        timeout=120,
        check=True,
    )
    answers = [json.loads(a) for a in done.stdout.decode().splitlines()]
    assert len(answers) == len(requests), done.stderr.decode()
    return answers


@pytest.fixture(scope="module")
def cases() -> Iterator[tuple[list[str], list[dict[str, Any]]]]:
    rng = random.Random(44)
    yield prompts(rng, 300), chats(rng, 100)


def test_ids_equal_hugging_faces(cases: tuple[list[str], list[dict[str, Any]]]) -> None:
    texts, conversations = cases
    hf = transformers.AutoTokenizer.from_pretrained(str(TINY_LLAMA))
    got = frontend_ids([{"prompt": t} for t in texts] + conversations)
    for text, answer in zip(texts, got):
        assert answer.get("ids") == hf(text)["input_ids"], repr(text)
    for chat, answer in zip(conversations, got[len(texts) :]):
        rendered = hf.apply_chat_template(
            flattened(chat["messages"]),
            tokenize=False,
            add_generation_prompt=chat["add_generation_prompt"],
        )
        assert answer.get("text") == rendered, chat
        assert (
            answer.get("ids") == hf(rendered, add_special_tokens=False)["input_ids"]
        ), chat


def test_ids_equal_vllms_own_tokenize(
    tmp_path: Path, cases: tuple[list[str], list[dict[str, Any]]]
) -> None:
    pytest.importorskip(
        "vllm", reason="vLLM's CPU build is in the project's environment"
    )
    texts, conversations = cases
    got = frontend_ids([{"prompt": t} for t in texts] + conversations)
    server = VllmServer(tmp_path / "vllm.log")
    try:
        mismatched = []
        for text, answer in zip(texts, got):
            want = server.post("/tokenize", {"model": server.name, "prompt": text})[
                "tokens"
            ]
            if answer.get("ids") != want:
                mismatched.append(("prompt", text, answer, want))
        for chat, answer in zip(conversations, got[len(texts) :]):
            want = server.post("/tokenize", {"model": server.name, **chat})["tokens"]
            if answer.get("ids") != want:
                mismatched.append(("chat", chat, answer, want))
        print(
            f"{len(texts)} prompts and {len(conversations)} chats: "
            f"{len(mismatched)} differ from vLLM's /tokenize"
        )
        assert not mismatched, mismatched[:3]
    finally:
        server.stop()


def test_bad_requests_get_an_error_line_and_the_rest_still_answer() -> None:
    got = frontend_ids(
        [
            {"messages": [{"role": "wizard", "content": "hi"}]},
            {"prompt": 3},
            {"messages": []},
            {"prompt": "still here"},
        ]
    )
    assert "unknown role: wizard" in got[0]["error"]
    assert "prompt" in got[1]["error"]
    assert "non-empty" in got[2]["error"]
    assert got[3]["ids"][0] == 1
