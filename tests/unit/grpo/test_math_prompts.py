"""GSM8K prompts of GRPO, built as the trainer builds them, against hand-rendered token ids.

The bundled tiny tokenizer uses the plain (HH-RLHF) template, whose markers are single pieces
of its vocabulary, so the expected tokens of a prompt are written out here without the chat
template code: ``[BOS]`` + the tokens of ``"\\n\\nHuman: " + user message + "\\n\\nAssistant:"``
(the generation prompt, so the model starts the assistant turn rather than continuing the
user's). A prompt over the limit is left-truncated keeping its head ``[BOS, "\\n\\nHuman:"]``.
"""

from __future__ import annotations

import json

import pytest

from megatron_prune.config import CheckpointConfig, ModelConfig, TrainConfig
from megatron_prune.data import GSM8K_SAMPLE
from megatron_prune.data.tokenizer import load_tokenizer
from megatron_prune.grpo.config import GRPOConfig
from megatron_prune.grpo.trainer import build_source
from megatron_prune.model.arch import get_preset

INSTRUCTION = '\nLet\'s think step by step and output the final answer after "####".'
"""What ``GSM8K_PROMPT_TEMPLATE`` (megatron_prune/data/math.py) appends to each question, written out."""


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny")


@pytest.fixture(scope="module")
def questions():
    with open(GSM8K_SAMPLE, encoding="utf-8") as f:
        return [json.loads(line)["question"] for line in f if line.strip()]


def gsm8k_source(**train):
    return build_source(GRPOConfig(task="gsm8k", data_path=[GSM8K_SAMPLE]), arch=get_preset("tiny"),
                        model_cfg=ModelConfig(), ckpt_cfg=CheckpointConfig(), train_cfg=TrainConfig(**train),
                        tokenizer_name="tiny")


def expected_tokens(tokenizer, question: str) -> list[int]:
    """The plain-template rendering of the one user turn plus the generation prompt, encoded."""
    return [tokenizer.bos_id] + tokenizer.encode("\n\nHuman: " + question + INSTRUCTION + "\n\nAssistant:")


def markers(tokenizer) -> tuple[int, int]:
    human, assistant = tokenizer.encode("\n\nHuman:"), tokenizer.encode("\n\nAssistant:")
    assert len(human) == 1 and len(assistant) == 1  # single pieces of the tiny vocabulary
    return human[0], assistant[0]


def test_prompts_are_the_user_turn_with_the_generation_prompt(tokenizer, questions):
    human, assistant = markers(tokenizer)
    source = gsm8k_source()  # limit: --seq-length 1024 - --max-new-tokens 16, far above these prompts
    assert len(source) == len(questions)
    for i in range(5):
        prompt = source.get(i)
        expected = expected_tokens(tokenizer, questions[i])
        assert len(expected) < 200
        assert list(prompt.tokens) == expected
        assert not prompt.truncated
        assert list(prompt.tokens[:2]) == [tokenizer.bos_id, human]
        assert prompt.tokens[-1] == assistant  # ends on the assistant header, not inside the user turn
        assert list(prompt.tokens).count(assistant) == 1


@pytest.mark.parametrize("limit", [12, 30])
def test_long_prompts_keep_the_head_and_the_tail(tokenizer, questions, limit):
    human, assistant = markers(tokenizer)
    source = gsm8k_source(max_prompt_length=limit)
    for i in range(5):
        prompt = source.get(i)
        full = expected_tokens(tokenizer, questions[i])
        assert len(full) > limit
        head = [tokenizer.bos_id, human]
        assert list(prompt.tokens) == head + full[len(full) - (limit - len(head)):]
        assert len(prompt.tokens) == limit
        assert prompt.truncated
        assert prompt.tokens[-1] == assistant


def test_a_prompt_cut_inside_a_character_starts_after_it(tmp_path, tokenizer):
    """The tiny tokenizer spells CJK characters as byte tokens; a cut through one must not leave its
    orphan bytes (decoded: U+FFFD) at the start of the kept tail, nor lose more than those bytes."""
    data = tmp_path / "cjk.jsonl"
    question = "小明有三个苹果，又买了五个，然后吃掉两个。他现在有几个苹果？"
    data.write_text(json.dumps({"question": question, "answer": "3 + 5 - 2 = 6\n#### 6"}, ensure_ascii=False) + "\n",
                    encoding="utf-8")
    full = expected_tokens(tokenizer, question)
    assert "\ufffd" not in tokenizer.decode(full)
    cut_inside = 0
    for limit in range(8, len(full)):
        tokens = list(build_source(GRPOConfig(task="gsm8k", data_path=[str(data)]), arch=get_preset("tiny"),
                                   model_cfg=ModelConfig(), ckpt_cfg=CheckpointConfig(),
                                   train_cfg=TrainConfig(max_prompt_length=limit), tokenizer_name="tiny").get(0).tokens)
        tail = tokenizer.decode(tokens[2:])
        assert "\ufffd" not in tail, (limit, tail)
        assert limit - 3 <= len(tokens) <= limit
        cut_inside += tokenizer.decode(full[len(full) - (limit - 2):]).startswith("\ufffd")
    assert cut_inside > 0  # the limits tried do cut through characters


def test_limit_defaults_to_what_the_completion_leaves(tokenizer, questions):
    # no --max-prompt-length: a prompt gets --seq-length - --max-new-tokens = 40 - 16 tokens
    human, _ = markers(tokenizer)
    prompt = gsm8k_source(seq_length=40).get(0)
    full = expected_tokens(tokenizer, questions[0])
    assert len(prompt.tokens) == 24 and prompt.truncated
    assert list(prompt.tokens) == [tokenizer.bos_id, human] + full[-22:]


def test_the_generation_configs_eos_ids_end_completions_too(tmp_path, caplog):
    """A chat model may end its turns with another token than its tokenizer's eos (Qwen3-Base, the first
    Llama-3-Instruct release): the eos ids of its generation_config.json end a completion as well."""
    from tests.unit.data.helpers import CHAT_TEMPLATE, save_hf_tokenizer

    directory = save_hf_tokenizer(tmp_path / "tok", chat_template=CHAT_TEMPLATE)
    (tmp_path / "tok" / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1, 10**9, True]}))
    tokenizer = load_tokenizer(directory)
    assert tokenizer.eos_id == 2 and tokenizer.stop_ids == {1, 2}  # ids outside the vocabulary are dropped
    source = build_source(GRPOConfig(task="gsm8k", data_path=[GSM8K_SAMPLE]), arch=get_preset("tiny"),
                          model_cfg=ModelConfig(), ckpt_cfg=CheckpointConfig(), train_cfg=TrainConfig(),
                          tokenizer_name=directory)
    assert source.eos_id == 2 and source.stop_ids == {1}
    # --tokenizer from elsewhere: the model directory's list is the one that counts
    model = tmp_path / "model"
    model.mkdir()
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    source = build_source(GRPOConfig(task="gsm8k", data_path=[GSM8K_SAMPLE]), arch=get_preset("tiny"),
                          model_cfg=ModelConfig(hf_model=str(model)), ckpt_cfg=CheckpointConfig(),
                          train_cfg=TrainConfig(), tokenizer_name=directory)
    assert source.stop_ids == {0}
    (tmp_path / "tok" / "generation_config.json").write_text("{not json")
    assert load_tokenizer(directory).stop_ids == {2}
    assert "generation_config.json: not read" in caplog.text


def test_a_template_that_opens_the_reasoning_grades_the_completion_inside_it(tmp_path):
    """Qwen3 thinking models end the generation prompt with "<think>": a completion cut before its
    "</think>" is unfinished reasoning and has no answer, whatever its last number."""
    from tests.unit.data.helpers import save_hf_tokenizer

    template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|><think>\n{% endif %}")
    directory = save_hf_tokenizer(tmp_path / "tok", chat_template=template)
    tokenizer = load_tokenizer(directory)
    source = build_source(GRPOConfig(task="gsm8k", data_path=[GSM8K_SAMPLE]), arch=get_preset("tiny"),
                          model_cfg=ModelConfig(), ckpt_cfg=CheckpointConfig(), train_cfg=TrainConfig(),
                          tokenizer_name=directory)
    prompt = source.get(0)
    answer = prompt.answer
    assert source.score(prompt, tokenizer.encode(f"so it is {answer}")) == 0.0
    assert source.score(prompt, tokenizer.encode(f"so it is {answer}\n</think>\n#### {answer}")) == 1.0


def test_chat_template_kwargs_reach_the_prompts(tmp_path):
    """--chat-template-kwargs '{"enable_thinking": false}': each prompt ends with Qwen3's empty think
    block, closed, so a completion's plain answer is graded as the answer."""
    from tests.unit.data.helpers import QWEN3_TEMPLATE, save_hf_tokenizer

    directory = save_hf_tokenizer(tmp_path / "tok", chat_template=QWEN3_TEMPLATE)
    tokenizer = load_tokenizer(directory)

    def source(**model):
        return build_source(GRPOConfig(task="gsm8k", data_path=[GSM8K_SAMPLE]), arch=get_preset("tiny"),
                            model_cfg=ModelConfig(**model), ckpt_cfg=CheckpointConfig(), train_cfg=TrainConfig(),
                            tokenizer_name=directory)

    thinking, plain = source(), source(chat_template_kwargs='{"enable_thinking": false}')
    assert tokenizer.decode(thinking.get(0).tokens).endswith("<|im_start|>assistant\n")
    prompt = plain.get(0)
    assert tokenizer.decode(prompt.tokens).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert plain.score(prompt, tokenizer.encode(f"#### {prompt.answer}")) == 1.0


def test_the_stop_token_that_ends_a_completion_is_not_graded(tmp_path):
    """The sampler keeps the eos that ended a completion; the reward reads the completion's text
    without it, so an answer that runs to the end of the text (MATH's brace-less ``\\boxed 5``) is
    graded as written, not with ``</s>`` glued to it."""
    from tests.unit.data.helpers import CHAT_TEMPLATE, save_hf_tokenizer

    directory = save_hf_tokenizer(tmp_path / "tok", chat_template=CHAT_TEMPLATE)
    data = tmp_path / "math.jsonl"
    data.write_text(json.dumps({"problem": "What is 2+3?", "solution": "It is $\\boxed{5}$."}) + "\n")
    tokenizer = load_tokenizer(directory)
    source = build_source(GRPOConfig(task="math", data_path=[str(data)]), arch=get_preset("tiny"),
                          model_cfg=ModelConfig(), ckpt_cfg=CheckpointConfig(), train_cfg=TrainConfig(),
                          tokenizer_name=directory)
    prompt = source.get(0)
    for text, reward in (("The answer is $\\boxed 5", 1.0), ("The answer is \\boxed{5}", 1.0),
                         ("The answer is $\\boxed 6", 0.0)):
        ids = tokenizer.encode(text)
        assert source.score(prompt, ids) == reward, text
        assert source.score(prompt, ids + [tokenizer.eos_id]) == reward, text
