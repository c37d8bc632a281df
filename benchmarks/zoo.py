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


# Channels of the residual stream that carry the "massive activations" below.
MASSIVE_CHANNELS = (5, 37)


def with_massive_activations(
    model: Logits, projection: nn.Linear, args: tuple, magnitude: float = 2000.0
) -> Logits:
    """``model`` with the "massive activations" of trained LLMs (Sun et al., 2024): a
    few channels of the residual stream reach |x| ~ ``magnitude`` from the first
    layer on. Random weights never show them; here the rows of ``projection`` (the
    first layer's last projection into the residual stream) that write
    ``MASSIVE_CHANNELS`` are scaled until their largest output on ``args`` is
    ``magnitude``. Every norm after that layer then squares values in the
    thousands, beyond fp16; the norms before it do not."""
    outputs = []
    handle = projection.register_forward_hook(lambda module, inputs, out: outputs.append(out))
    with torch.no_grad():
        model(*args)
        handle.remove()
        for channel in MASSIVE_CHANNELS:
            largest = outputs[0][..., channel].abs().max()
            projection.weight[channel] *= magnitude / largest
    return model


def massive_llama(layers: int = 3, magnitude: float = 2000.0) -> Logits:
    """``llama(layers)`` whose first MLP writes massive activations
    (``with_massive_activations``), for the example ids ``massive_ids()``."""
    model = llama(layers)
    projection = model.model.model.layers[0].mlp.down_proj
    return with_massive_activations(model, projection, (massive_ids(),), magnitude)


def massive_t5_encoder(magnitude: float = 2000.0) -> Logits:
    """``t5_encoder()`` whose first feed-forward block writes massive activations."""
    model = t5_encoder()
    projection = model.model.encoder.block[0].layer[1].DenseReluDense.wo
    return with_massive_activations(model, projection, (massive_ids(),), magnitude)


def massive_ids() -> torch.Tensor:
    """The example token ids the massive-activation models are scaled for."""
    return torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(11))


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


def llama(layers: int = 2, vocab: int = 512) -> Logits:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        use_cache=False,
    )
    return Logits(LlamaForCausalLM(config).eval())


class DecoderStep(nn.Module):
    """One decoding step of a transformers causal LM with the static KV cache that
    transformers' ExecuTorch integration exports for on-device use
    (``transformers.integrations.executorch``): (token ids, cache position) -> logits,
    with the cache's fp32 key/value buffers updated in place. Export it with
    ``strict=True``, as transformers does (``strict_export``): non-strict export leaves
    a program that ``run_decompositions`` refuses."""

    strict_export = True

    def __init__(self, model: nn.Module, max_cache_len: int = 32) -> None:
        from transformers import GenerationConfig
        from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

        super().__init__()
        model.generation_config = GenerationConfig(
            use_cache=True,
            cache_implementation="static",
            max_length=max_cache_len,
            cache_config={"batch_size": 1, "max_cache_len": max_cache_len},
        )
        self.step = TorchExportableModuleWithStaticCache(model)

    def forward(self, input_ids, cache_position):
        return self.step(input_ids=input_ids, cache_position=cache_position)


def llama_decoder(layers: int = 2) -> DecoderStep:
    """``llama(layers)`` as a one-token decoder with a static KV cache."""
    return DecoderStep(llama(layers).model)


class Features(nn.Module):
    """A transformers encoder taking features (pixels, mel frames) -> last hidden state."""

    def __init__(self, model: nn.Module, argument: str) -> None:
        super().__init__()
        self.model, self.argument = model, argument

    def forward(self, features):
        return self.model(**{self.argument: features}).last_hidden_state


def vit() -> Features:
    from transformers import ViTConfig, ViTModel

    config = ViTConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        image_size=32,
        patch_size=8,
    )
    return Features(ViTModel(config).eval(), "pixel_values")


def whisper_encoder() -> Features:
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    config = WhisperConfig(
        d_model=64,
        encoder_layers=2,
        encoder_attention_heads=4,
        encoder_ffn_dim=128,
        num_mel_bins=16,
        max_source_positions=32,
        vocab_size=512,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
        decoder_start_token_id=0,
    )
    return Features(WhisperEncoder(config).eval(), "input_features")


class ResNetish(nn.Module):
    """Two residual conv blocks with BatchNorm, pooling and a classifier."""

    def __init__(self, channels: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.Conv2d(channels, channels, 3, padding=1),
                nn.BatchNorm2d(channels),
                nn.ReLU(),
                nn.Conv2d(channels, channels, 3, padding=1),
                nn.BatchNorm2d(channels),
            )
            for _ in range(2)
        )
        self.head = nn.Linear(channels, classes)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        for block in self.blocks:
            x = torch.relu(x + block(x))
        return self.head(x.mean((2, 3)))


class LSTMTagger(nn.Module):
    """Embedding, a one-layer LSTM and a tag head."""

    def __init__(self, vocab: int = 512, width: int = 32, tags: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.lstm = nn.LSTM(width, width, batch_first=True)
        self.head = nn.Linear(width, tags)

    def forward(self, ids):
        hidden, _ = self.lstm(self.embed(ids))
        return self.head(hidden)


def bert_gelu_tanh(layers: int = 2, width: int = 128) -> Logits:
    """A BERT whose activation is GELU's tanh approximation written out (``gelu_new``,
    GPT-2's): ``0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))``."""
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=512,
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=4 * width,
        max_position_embeddings=128,
        hidden_act="gelu_new",
    )
    return Logits(BertModel(config).eval())


def qwen2_moe(layers: int = 2, experts: int = 8) -> Logits:
    """A mixture-of-experts LM from a Qwen2-MoE config: a router per layer picks the top
    2 of ``experts`` experts for each token, next to a shared expert."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=experts,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        use_cache=False,
    )
    return Logits(Qwen2MoeForCausalLM(config).eval())


class RWKVLogits(nn.Module):
    """An RWKV language model (transformers' RWKV-4): a recurrent state model whose
    WKV recurrence keeps a running maximum that starts at -1e38."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        from transformers import RwkvConfig, RwkvForCausalLM

        config = RwkvConfig(
            vocab_size=512,
            hidden_size=64,
            num_hidden_layers=layers,
            attention_hidden_size=64,
            intermediate_size=128,
            context_length=64,
        )
        self.model = RwkvForCausalLM(config).eval()

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


class DiffusionUNet(nn.Module):
    """A small diffusers ``UNet2DConditionModel`` (a denoising step: noisy latents,
    timestep, text states -> noise), with cross-attention blocks."""

    def __init__(self) -> None:
        super().__init__()
        from diffusers import UNet2DConditionModel

        self.unet = UNet2DConditionModel(
            sample_size=16,
            in_channels=4,
            out_channels=4,
            layers_per_block=1,
            block_out_channels=(32, 64),
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=32,
            attention_head_dim=8,
            norm_num_groups=8,
        ).eval()

    def forward(self, latents, timestep, text):
        return self.unet(latents, timestep, encoder_hidden_states=text).sample
