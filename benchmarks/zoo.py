"""Models the benchmarks (and some tests) share: transformers models built from configs
with random weights (nothing is downloaded), and small hand-written traps."""

import torch
from torch import nn


class Logits(nn.Module):
    """A transformers model as a tensor -> tensor function (logits, or the last hidden state)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask=None):
        output = self.model(input_ids=input_ids, attention_mask=attention_mask)
        return output.logits if hasattr(output, "logits") else output.last_hidden_state


def gpt2(layers: int = 2, width: int = 128, heads: int = 4, vocab: int = 1024) -> Logits:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=layers,
        n_embd=width,
        n_head=heads,
        vocab_size=vocab,
        n_positions=128,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )
    return Logits(GPT2LMHeadModel(config).eval())


def bert(layers: int = 2, width: int = 64, vocab: int = 512, initializer_range=0.02) -> Logits:
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=vocab,
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=2 * width,
        max_position_embeddings=128,
        initializer_range=initializer_range,
    )
    return Logits(BertModel(config).eval())


def t5_encoder(initializer_factor: float = 1.0, vocab: int = 512) -> Logits:
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=vocab,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_heads=4,
        feed_forward_proj="gated-gelu",
        initializer_factor=initializer_factor,
    )
    return Logits(T5EncoderModel(config).eval())


class SquaredSum(nn.Module):
    """A Linear whose outputs are squared and summed (an energy), then normalised."""

    def __init__(self, width: int = 16, features: int = 256, scale: float = 40.0) -> None:
        super().__init__()
        self.fc = nn.Linear(width, features)
        with torch.no_grad():
            self.fc.weight.mul_(scale)

    def forward(self, x):
        h = self.fc(x)
        return h / h.pow(2).sum(-1, keepdim=True).sqrt()


class ExpLogits(nn.Module):
    """exp of logits around 12 (e^12 > 65504), normalised by hand."""

    def __init__(self, width: int = 16, features: int = 32) -> None:
        super().__init__()
        self.fc = nn.Linear(width, features)
        with torch.no_grad():
            self.fc.bias.fill_(12.0)

    def forward(self, x):
        weights = self.fc(x).exp()
        return weights / weights.sum(-1, keepdim=True)


class ScaledAttention(nn.Module):
    """Attention without 1/sqrt(d): ``scale`` multiplies the q and k weights.

    scale 3-4: logits large enough that fp16 rounding of q and k moves the softmax;
    scale 150: scores beyond 65504.
    """

    def __init__(self, width: int = 32, scale: float = 3.0) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        with torch.no_grad():
            self.q.weight.mul_(scale)
            self.k.weight.mul_(scale)

    def forward(self, x):
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        return scores.softmax(-1) @ self.v(x)


class BucketHash(nn.Module):
    """Hash ids into 97 buckets, plus a pairwise sum that fits int16."""

    def forward(self, ids, other):
        return (ids * 1000 + ids) % 97, ids + other


class RunningCount(nn.Module):
    """Counts events along a sequence: the cumsum outgrows int16 for long sequences."""

    def forward(self, events, weights):
        return (events * weights).cumsum(-1), events - weights
