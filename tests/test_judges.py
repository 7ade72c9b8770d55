"""Judges: the programmatic judge's aggregates, and the reward-model judge on a real (tiny, hand-wired) model.

The reward model is a two-layer Llama sequence classifier whose weights are set by hand so that its reward is
known in advance: the attention of layer 0 averages a "sentiment" coordinate over the whole text (the embedding
of "good" carries +3 there, "bad" -3, every other token 0), the MLPs and layer 1 add nothing, and the score head
reads that coordinate at the last non-padding token. So the reward has the sign of (#good - #bad) and grows with
the share of "good" tokens in the text. Its answers are judged through the real tokenizer, padding and pooling path.
"""

import json
import math
import sys

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerFast

from src.judges import Judge, JudgeError, JudgeResult, ProgrammaticJudge, RewardModelJudge
from tests.report_fixtures import answers, arithmetic_check, arithmetic_rows

VOCAB = ["<pad>", "<eos>", "<unk>", "good", "bad", "the", "answer", "is", "what", "?", "please", "reply", "user:",
         "assistant:", "fine", "ok", "very"]
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] + ': ' + message['content'] + ' ' }}{% endfor %}"
                 "{{ eos_token }}")


def build_reward_model(directory, num_labels: int = 1) -> str:
    tokenizer = Tokenizer(models.WordLevel({word: index for index, word in enumerate(VOCAB)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                                        unk_token="<unk>")
    tokenizer.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, intermediate_size=64, pad_token_id=0, num_labels=num_labels)
    model = LlamaForSequenceClassification(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        embeddings = torch.randn(len(VOCAB), 32, generator=generator)
        embeddings[:, 0] = 0.0
        embeddings[VOCAB.index("bad")] = embeddings[VOCAB.index("good")]  # same norm: only the sign differs
        embeddings[VOCAB.index("good"), 0], embeddings[VOCAB.index("bad"), 0] = 3.0, -3.0
        model.model.embed_tokens.weight.copy_(embeddings)
        for layer in model.model.layers:
            for linear in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                           layer.self_attn.o_proj, layer.mlp.down_proj):
                linear.weight.zero_()
        # q = k = 0: uniform attention over the prefix; v and o carry coordinate 0 through head 0.
        model.model.layers[0].self_attn.v_proj.weight[0, 0] = 1.0
        model.model.layers[0].self_attn.o_proj.weight[0, 0] = 1.0
        model.score.weight.zero_()
        model.score.weight[:, 0] = 1.0
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def reward_model_path(tmp_path_factory):
    return build_reward_model(tmp_path_factory.mktemp("reward_model"))


def rows_for(prompts, chosen=None):
    """Rows as the training job passes them; a string prompt is rendered text the answer directly follows."""
    return [{"prompt": prompt, "meta": {}, **({"chosen": chosen[i]} if chosen else {})}
            for i, prompt in enumerate(prompts)]


# --------------------------------------------------------------------------------------------- programmatic


def test_programmatic_judge_aggregates_scores_and_sub_criteria():
    rows = arithmetic_rows("test", 4)
    expected = [str(row["meta"]["answer"]) for row in rows]
    reference = [expected[0], expected[1], "0", f"The answer is {expected[3]}."]
    trained = [f"The answer is {expected[0]}.", expected[1], f"The answer is {expected[2]}.", "7"]
    result = ProgrammaticJudge(arithmetic_check, metric="correct_and_preferred").judge(rows, reference, trained)
    assert (result.metric, result.n, result.judge) == ("correct_and_preferred", 4, "programmatic")
    assert result.before == 0.25 and result.after == 0.5
    assert result.details["correct"] == {"before": 0.75, "after": 0.75}
    assert result.details["preferred"] == {"before": 0.25, "after": 0.5}
    assert result.details["changes"] == {"improved": 2, "regressed": 1, "unchanged": 1}
    assert result.verdicts[2] == {"reference": {"score": 0.0, "correct": False, "preferred": False},
                                  "trained": {"score": 1.0, "correct": True, "preferred": True}}


def test_judge_result_to_dict_is_json_ready_without_verdicts():
    rows = arithmetic_rows("val", 10)
    result = ProgrammaticJudge(arithmetic_check).judge(rows, answers(rows, 0.5, 0.0, "a"), answers(rows, 0.9, 0.9, "b"))
    as_dict = result.to_dict()
    assert "verdicts" not in as_dict and len(result.verdicts) == 10
    assert json.loads(json.dumps(as_dict)) == as_dict
    assert set(as_dict) == {"metric", "n", "before", "after", "details", "judge"}


def test_programmatic_judge_rejects_mismatched_inputs_and_bad_checks():
    rows = arithmetic_rows("val", 3)
    with pytest.raises(ValueError, match="3 rows but 2 reference answers"):
        ProgrammaticJudge(arithmetic_check).judge(rows, ["1", "2"], ["1", "2", "3"])
    with pytest.raises(ValueError, match="numeric 'score'"):
        ProgrammaticJudge(lambda row, answer: {"correct": True}).judge(rows, ["1"] * 3, ["1"] * 3)


def test_programmatic_judge_on_nothing_reports_nan():
    result = ProgrammaticJudge(arithmetic_check).judge([], [], [])
    assert result.n == 0 and math.isnan(result.before) and math.isnan(result.after)



class ScriptedJudge(Judge):
    """A judge whose scoring returns or raises what it is given: what a reward model or a service can do."""
    name = "scripted"

    def __init__(self, outcome):
        self.outcome = outcome

    def _scores(self, rows, answers):
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome

    def _judge(self, rows, reference_answers, trained_answers):
        raise self.outcome


@pytest.mark.parametrize("judge, message", [
    (ScriptedJudge(RuntimeError("CUDA out of memory")), "judge scripted: raised RuntimeError: CUDA out of memory"),
    (ScriptedJudge([1.0]), "judge scripted: returned 1 scores for 2 answers"),
    (ScriptedJudge([1.0, math.nan]), "judge scripted, prompt 'what is 2 ?': returned nan; a judge returns a finite"),
    (ScriptedJudge([1.0, "0.5"]), "judge scripted, prompt 'what is 2 ?': returned '0.5'"),
    (ProgrammaticJudge(lambda row, answer: sys.exit("no checker here"), name="exits"),
     "judge exits, prompt 'what is 1 ?': raised SystemExit: no checker here"),
])
def test_whatever_fails_inside_a_judge_is_one_judge_error(judge, message):
    """Every caller (GRPO's rewards, a round, the data audit) stops every process on a JudgeError: so a judge's
    scores raise nothing else, whatever its code raises (a SystemExit too), and no count or value TRL would take."""
    rows = rows_for(["what is 1 ?", "what is 2 ?"])
    with pytest.raises(JudgeError) as raised:
        judge.scores(rows, ["1", "2"])
    assert message in str(raised.value)
    if isinstance(judge, ScriptedJudge) and isinstance(judge.outcome, BaseException):
        with pytest.raises(JudgeError, match="raised RuntimeError"):
            judge.judge(rows, ["1", "2"], ["1", "2"])

# --------------------------------------------------------------------------------------------- reward model


def test_reward_model_scores_follow_the_hand_wired_weights(reward_model_path):
    judge = RewardModelJudge(reward_model_path, batch_size=4, device="cpu")
    replies = ["good", "very good good", "bad", "the answer is ok", "bad bad good"]
    rewards = judge.score(["what is the answer ? "] * 5, replies)
    assert rewards[0] > 0 and rewards[1] > rewards[0] and rewards[2] < 0 and rewards[4] < 0
    assert abs(rewards[3]) < 1e-6  # neutral words only


def test_reward_model_scores_do_not_depend_on_batching_or_padding(reward_model_path):
    prompts = ["what is the answer ? ", "please reply ", "what ? ", "please reply please reply what is the answer ? "]
    replies = ["good", "the answer is very good good good fine", "bad", "ok"]
    one_by_one = RewardModelJudge(reward_model_path, batch_size=1, device="cpu").score(prompts, replies)
    batched = RewardModelJudge(reward_model_path, batch_size=4, device="cpu").score(prompts, replies)
    assert batched == pytest.approx(one_by_one, abs=1e-5)


def test_reward_model_win_rate(reward_model_path):
    prompts = ["what is the answer ? ", "please reply ", "what ? ", "please reply what ? ", "the answer ? ",
               "what is ? "]
    reference = ["bad", "ok", "bad bad", "fine", "good", "good good"]
    trained = ["good", "good ok", "ok", "fine", "bad", "good good good"]  # win win win tie loss win
    result = RewardModelJudge(reward_model_path, device="cpu").judge(
        rows_for(prompts, chosen=["good good good"] * 6), reference, trained)
    assert isinstance(result, JudgeResult)
    assert (result.metric, result.n, result.before) == ("win_rate", 6, 0.5)
    assert result.after == pytest.approx(4.5 / 6)
    assert result.details["outcomes"] == {"wins": 4, "ties": 1, "losses": 1}
    assert result.details["mean_reward"]["after"] > result.details["mean_reward"]["before"]
    # Against the fixed anchor "good good good" no answer wins; the last trained answer equals it: a tie.
    assert result.details["win_rate_vs_chosen"] == {"before": 0.0, "after": pytest.approx(0.5 / 6)}
    assert [verdict["trained"]["win"] for verdict in result.verdicts] == [1.0, 1.0, 1.0, 0.5, 0.0, 1.0]
    assert all(set(verdict["reference"]) == {"reward", "chosen_reward"} for verdict in result.verdicts)
    assert json.loads(json.dumps(result.to_dict()))["details"]["outcomes"]["wins"] == 4


def test_reward_model_applies_the_chat_template_to_chat_prompts(reward_model_path):
    judge = RewardModelJudge(reward_model_path, device="cpu")
    messages = [{"role": "user", "content": "what is the answer ?"}]
    ids = judge._input_ids(messages, "good")
    assert judge.tokenizer.decode(ids) == "user: what is the answer ? assistant: good <eos>"
    result = judge.judge(rows_for([messages, messages]), ["bad", "good"], ["good", "bad"])
    assert [verdict["trained"]["win"] for verdict in result.verdicts] == [1.0, 0.0]
    assert "win_rate_vs_chosen" not in result.details  # no chosen answers given


def test_reward_model_keeps_the_end_of_over_long_inputs(reward_model_path):
    judge = RewardModelJudge(reward_model_path, device="cpu", max_length=4)
    ids = judge._input_ids("please reply what is the answer ? ", "good")
    assert judge.tokenizer.decode(ids) == "answer ? good <eos>"


def test_a_classifier_with_two_labels_is_refused(tmp_path):
    path = build_reward_model(tmp_path / "classifier", num_labels=2)
    with pytest.raises(ValueError, match="num_labels=2"):
        RewardModelJudge(path, device="cpu")


def test_a_reward_model_trained_with_trls_reward_trainer_judges_the_style_it_learned(tmp_path, monkeypatch):
    """End to end with TRL: RewardTrainer learns "answers ending in good beat answers ending in bad" on random
    prompts; the judge, formatting text the way RewardTrainer did, must then rank held-out answers the same way."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    base = build_reward_model(tmp_path / "base")
    tokenizer = AutoTokenizer.from_pretrained(base)
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(LlamaConfig(
        vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        intermediate_size=64, pad_token_id=0, num_labels=1))
    rng = __import__("random").Random(0)
    pairs = []
    for _ in range(64):
        prompt = " ".join(rng.choice(["what", "please", "reply", "the", "answer", "?"]) for _ in range(4)) + " "
        filler = " ".join(rng.choice(["the", "answer", "is", "ok", "fine", "very"]) for _ in range(rng.randint(0, 3)))
        pairs.append({"prompt": prompt, "chosen": f"{filler} good".strip(), "rejected": f"{filler} bad".strip()})
    args = RewardConfig(output_dir=str(tmp_path / "out"), max_steps=30, per_device_train_batch_size=16,
                        learning_rate=3e-3, report_to=[], use_cpu=True, bf16=False, save_strategy="no",
                        activation_checkpointing=False, disable_tqdm=True)
    trainer = RewardTrainer(model=model, args=args, train_dataset=Dataset.from_list(pairs), processing_class=tokenizer)
    trainer.train()
    trainer.save_model(str(tmp_path / "rm"))
    tokenizer.save_pretrained(str(tmp_path / "rm"))

    judge = RewardModelJudge(str(tmp_path / "rm"), device="cpu")
    rows = rows_for(["what is the answer ? ", "please reply ", "reply the answer ? ", "what ? "])
    result = judge.judge(rows, ["bad", "ok bad", "the answer is bad", "very fine"],
                         ["good", "ok good", "the answer is good", "very fine"])
    assert result.details["outcomes"] == {"wins": 3, "ties": 1, "losses": 0}
    assert result.after == pytest.approx(3.5 / 4)


# --------------------------------------------------------------------------------------------- reasoning answers


THOUGHT = "<think>\nThe answer is 7? No, it is good.\n</think>\n\n"


def test_every_judge_scores_the_final_answer_and_a_function_can_ask_for_the_reasoning(reward_model_path):
    """A reasoning answer is judged on what follows its reasoning; an answer whose reasoning never closed has no final
    answer (""). The checks see exactly that."""
    rows = arithmetic_rows("test", 2)
    expected = [str(row["meta"]["answer"]) for row in rows]
    reasoning_first = [f"<think>\nIt is {expected[0]} plus nothing.\n</think>\n\nThe answer is 0.",
                       f"{expected[1]}? check\n</think>\n\n{expected[1]}"]  # R1: the prompt opened the <think>
    seen = []
    result = ProgrammaticJudge(lambda row, answer: seen.append(answer) or arithmetic_check(row, answer)).judge(
        rows, reasoning_first, [f"<think>\n{expected[0]}", expected[1]])
    assert seen == ["The answer is 0.", "", expected[1], expected[1]]  # reference 1, trained 1, reference 2, trained 2
    # The cut answer names the right number inside its reasoning, but has no final answer: it scores nothing.
    assert [verdict["trained"]["correct"] for verdict in result.verdicts] == [False, True]
    asked = []
    ProgrammaticJudge(lambda row, answer, reasoning: asked.append((answer, reasoning)) or 1.0).scores(
        rows[:1], [reasoning_first[0]])
    assert asked == [("The answer is 0.", f"It is {expected[0]} plus nothing.")]
    judge = RewardModelJudge(reward_model_path, device="cpu")
    assert judge.score(["what ? "] * 2, [THOUGHT + "bad", "bad"]) == pytest.approx(judge.score(["what ? "] * 2,
                                                                                                ["bad", "bad"]))


def test_a_generated_answer_starts_with_the_reasoning_block_its_prompt_opened(tiny_model):
    """DeepSeek-R1's generation prompt ends with "<think>\\n": the generated text is prefixed with it, so a judge and
    the audit know where the reasoning starts and whether it closed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from src.chat_templates import opened_reasoning
    from src.generation import generate

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    plain = tokenizer("<|user|>what is the answer<|assistant|>", add_special_tokens=False)["input_ids"]
    opened = tokenizer("<|user|>what is the answer<|assistant|><think>\n", add_special_tokens=False)["input_ids"]
    assert opened_reasoning(tokenizer, plain) == "" and opened_reasoning(tokenizer, opened) == "<think>\n"
    closed = tokenizer("<|assistant|><think>\nhm\n</think>\n\n", add_special_tokens=False)["input_ids"]
    assert opened_reasoning(tokenizer, closed) == ""
    first, second = generate(model, tokenizer, [plain, opened], max_new_tokens=4, batch_size=2)
    assert not first.startswith("<think>") and second.startswith("<think>\n")
