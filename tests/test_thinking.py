"""A thinking budget in the engine (``server/engine/thinking.py``): a request thinks for at most
its budget, then the sampler emits the block's end marker and the model goes on from there.

A tiny random llama stands in for a reasoning model: its markers are ordinary token ids the
test picks (from the model's own greedy output where the block must open by itself). Every
run goes through the runner as the server drives it, one decode step queued ahead of the
last one's tokens, so a budget row's samples wait for its previous token (``Draw.complete``).
"""

from __future__ import annotations

import pytest
from archs import build_model, prompt_tokens
from stepping import drive

from kvserve.cache import parse_scheme
from kvserve.server.engine.request import Request, SamplingParams
from kvserve.server.engine.runner import ModelRunner
from kvserve.server.engine.thinking import BudgetState, ThinkingBudget

# Prompts whose greedy replies vary (a random model often repeats one token from the start).
PROMPTS = [prompt_tokens(seed, 13) for seed in (304, 310, 302, 307)]
END = (60, 61)  # a two-token end marker (as "<|channel|>...<|end|>" formats have)
N = 24


@pytest.fixture(scope="module")
def model():
    return build_model("llama", seed=1)


def run(model, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    runner = ModelRunner(model, parse_scheme("fp16"))
    reqs = [Request(list(p), q, request_id=f"r{i}") for i, (p, q) in enumerate(zip(prompts, params))]
    trace = drive(runner, reqs)
    return [trace.tokens[f"r{i}"] for i in range(len(prompts))]


def greedy(thinking: ThinkingBudget | None = None, n: int = N) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, thinking=thinking)


def test_an_open_block_ends_at_its_budget_and_the_model_answers_after_the_marker(model):
    """Prompt ended inside the block: the first 5 tokens are the model's own, then the two
    marker tokens, then what the model says after prompt + those 7 tokens."""
    plain = run(model, PROMPTS[:1], [greedy()])[0]
    assert not set(END) & set(plain[:5])
    budgeted = run(model, PROMPTS[:1], [greedy(ThinkingBudget(5, start=(50,), end=END, open=True))])[0]
    assert budgeted[:7] == plain[:5] + list(END)
    after = run(model, [PROMPTS[0] + budgeted[:7]], [greedy(n=N - 7)])[0]
    assert budgeted[7:] == after


def test_a_block_the_model_opens_counts_from_its_start_marker(model):
    """The start marker is two tokens the model writes itself (its greedy tokens 2 and 3):
    the budget of 3 counts from after them."""
    plain = run(model, PROMPTS[:1], [greedy()])[0]
    start = tuple(plain[2:4])
    budgeted = run(model, PROMPTS[:1], [greedy(ThinkingBudget(3, start=start, end=END))])[0]
    assert budgeted[:9] == plain[:7] + list(END)


def test_budget_rows_beside_others_leave_them_as_they_were(model):
    """A batch of four, two with budgets (one greedy, one sampled with a seed): the greedy
    rows decode as without the others; the sampled budget row is forced at its budget and
    samples as it would alone up to there. (After that its seeded draws may part from the
    lone run's: the CPU BLAS rounds a one-row product unlike a four-row one, and storing K/V
    as float16 can carry that rounding into a half-ulp step of a cached value, enough to move
    a sample across a boundary of its cumulative distribution.)"""
    sampled = SamplingParams(max_tokens=N, temperature=0.9, seed=11,
                             thinking=ThinkingBudget(4, start=(50,), end=END, open=True))
    params = [greedy(), greedy(ThinkingBudget(6, start=(50,), end=END, open=True)), sampled, greedy()]
    together = run(model, PROMPTS, params)
    alone = [run(model, [p], [q])[0] for p, q in zip(PROMPTS, params)]
    assert [together[i] for i in (0, 1, 3)] == [alone[i] for i in (0, 1, 3)]
    assert together[2][:6] == alone[2][:6]
    assert together[1][6:8] == list(END) and together[2][4:6] == list(END)
    assert together[0] == run(model, PROMPTS[:1], [greedy()])[0]


def test_a_block_closed_by_the_model_is_not_forced_again():
    state = BudgetState(ThinkingBudget(3, start=(8,), end=(9,), open=True))
    for token in (1, 9, 2, 3, 4, 5):  # the model closes the block after one token
        assert state.forced() is None
        state.observe(token)
    assert (state.inside, state.spent) == (False, 1)
    state.observe(8)  # a second block: the budget counts over both
    state.observe(1)
    assert state.spent == 2 and state.forced() is None
    state.observe(1)
    assert state.forced() == 9


OPENING_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant><think>\n"


@pytest.mark.parametrize("template, opens", [(OPENING_TEMPLATE, True),
                                              (OPENING_TEMPLATE.replace("<think>\n", ""), False)])
def test_a_chat_gets_the_markers_of_a_reasoning_tokenizer(default_model_dir, tmp_path, template, opens):
    """The default tokenizer with ``<think>`` and ``</think>`` added (mlx-lm then reports
    reasoning markers): the prepared chat's budget carries their ids, and whether the
    template opened the block; without markers there is no budget to enforce."""
    from mlx_lm.tokenizer_utils import load
    from transformers import AutoTokenizer

    from kvserve.server.http.chat import ChatInput, prepare_chat

    plain = load(default_model_dir)
    hf = AutoTokenizer.from_pretrained(str(default_model_dir))
    hf.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    hf.save_pretrained(str(tmp_path))
    tokenizer = load(tmp_path)
    assert tokenizer.has_thinking
    start, end = (hf.convert_tokens_to_ids(t) for t in ("<think>", "</think>"))
    chat = ChatInput(messages=[{"role": "user", "content": "hi"}], tools=None)
    for t in (tokenizer, plain):
        t._tokenizer.chat_template = template
    assert prepare_chat(chat, tokenizer).thinking_budget(1024) == ThinkingBudget(1024, (start,), (end,), opens)
    assert prepare_chat(chat, tokenizer).thinking_budget(None) is None
    assert prepare_chat(chat, plain).thinking_budget(1024) is None
