"""A converted model on the Hugging Face training stack: ``transformers.Trainer`` trains it with
the routing parameters receiving gradients, and ``peft`` LoRA adapters on the attention
projections train beside the routing, saved and reloaded with equal logits."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import attnres.hf  # noqa: E402  (registers the Auto classes)
from attnres.hf import convert, routing_parameters  # noqa: E402

pytestmark = pytest.mark.slow

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)


def converted():
    torch.manual_seed(0)
    source = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**SMALL))
    return convert(source, heads=4, block_layers=2)


class Tokens(torch.utils.data.Dataset):
    """Fixed random sequences of 32 tokens, their labels the same ids (the model shifts them)."""

    def __init__(self, n=32):
        self.ids = torch.randint(0, 256, (n, 32), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, k):
        return {"input_ids": self.ids[k], "labels": self.ids[k]}


def test_trainer_trains_a_converted_model_and_its_routing_learns(tmp_path):
    model = converted()
    start = {n: p.detach().clone() for n, p in routing_parameters(model).items()}
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4,
                                          learning_rate=1e-2, report_to=[], save_strategy="no", use_cpu=True,
                                          logging_steps=1, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens())
    result = trainer.train()
    assert result.global_step == 4
    moved = {n for n, p in routing_parameters(model).items() if not torch.equal(p.detach(), start[n])}
    assert "routing.gates" in moved and len(moved) >= 2, moved  # the gates open, the queries follow


def test_lora_on_the_attention_trains_beside_the_routing_and_reloads_with_equal_logits(tmp_path):
    model = converted()
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                             modules_to_save=["routing"])
    lora = peft.get_peft_model(model, config)
    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert any("lora_A" in n for n in trainable) and any("routing" in n for n in trainable)
    assert not any("mlp" in n or "embed" in n for n in trainable)  # the base stays frozen
    opt = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
    data = Tokens(8)
    for k in range(3):
        batch = data[k]
        out = lora(input_ids=batch["input_ids"][None], labels=batch["labels"][None])
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    lora.eval()
    x = data[5]["input_ids"][None]
    with torch.no_grad():
        before = lora(input_ids=x).logits
    lora.save_pretrained(str(tmp_path / "adapter"))
    reloaded = peft.PeftModel.from_pretrained(converted(), str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=x).logits, before)
