"""Models whose 16-bit safety depends on inputs the calibration never shows.

Each computes something that is accurate in 16-bit on the inputs it is calibrated
on and goes wrong on inputs real data brings later: wider logits, quieter frames, a
narrow column beside a wide one. fx16 must hold on them with its default options,
by a rewrite that is exact for every input or by a margin applied where the value
comes from. Each is built from a config with seeded weights, and ``inputs`` draws
the data it is calibrated on.
"""

import math

import torch
from torch import nn


def logit_head(width: int, outputs: int, spread: float) -> nn.Linear:
    """A linear layer whose logits are about N(0, spread) on unit normal inputs (each
    weight row scaled to norm ``spread``)."""
    head = nn.Linear(width, outputs)
    with torch.no_grad():
        head.weight.mul_(spread / head.weight.norm(dim=1, keepdim=True))
    return head


class TailEntropy(nn.Module):
    """The entropy ``-(p * log p).sum(-1)`` of a softmax whose smallest probability on
    the calibration inputs is about 1e-3: twice those logits square it to 1e-6, below
    fp16's normal range, and three times flush it to 0, where ``0 * log 0`` is nan.
    ``p`` has two readers, so no rewrite turns the log into a log_softmax."""

    def __init__(self, width: int = 16, classes: int = 32) -> None:
        super().__init__()
        self.head = logit_head(width, classes, spread=0.7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.head(x).softmax(-1)
        return -(p * p.log()).sum(-1)


class LogLikelihood(nn.Module):
    """``log(sigmoid(logits))``: logits three times wider than calibrated give a
    sigmoid below fp16's smallest subnormal, and its log -inf."""

    def __init__(self, width: int = 16, outputs: int = 8) -> None:
        super().__init__()
        self.head = logit_head(width, outputs, spread=3.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.sigmoid(self.head(x)))


class FrameRmsNorm(nn.Module):
    """An RMSNorm written by hand over audio frames, with a tiny eps and no fp32
    upcast, then a linear layer: a near-silent frame's squares flush to zero in fp16.
    ``divide``: ``x / sqrt(mean(x^2) + eps)`` instead of ``x * rsqrt(...)``."""

    def __init__(self, frame: int = 64, divide: bool = False, eps: float = 1e-10) -> None:
        super().__init__()
        self.divide, self.eps = divide, eps
        self.project = nn.Linear(frame, 16)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        power = frames.pow(2).mean(-1, keepdim=True) + self.eps
        if self.divide:
            return self.project(frames / torch.sqrt(power))
        return self.project(frames * torch.rsqrt(power))


class MixedColumns(nn.Module):
    """``(x - mean) / std`` over the batch, per column, then a linear layer. Column 0
    has a large offset and a small spread (a timestamp), the others are wide and
    centred: one ratio over the whole tensor is the wide columns', small, while the
    narrow column cancels three orders of magnitude."""

    def __init__(self, columns: int = 8) -> None:
        super().__init__()
        self.project = nn.Linear(columns, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(0, keepdim=True)
        std = x.std(0, keepdim=True)
        return self.project((x - mean) / std)


def mixed_columns(rows: int, seed: int, columns: int = 8) -> torch.Tensor:
    """Column 0 around 1000 +- 0.5, the others centred with spread 100."""
    generator = torch.Generator().manual_seed(seed)
    x = 100 * torch.randn(rows, columns, generator=generator)
    x[:, 0] = 1000 + 0.5 * torch.randn(rows, generator=generator)
    return x


class StftMagnitude(nn.Module):
    """A real DFT of audio frames as two products (cosine and sine bases), the
    magnitude ``sqrt(re^2 + im^2)`` and a linear layer without bias (features in
    proportion to the spectrum): quiet audio's squares flush to zero in fp16, loud
    audio's pass 65504."""

    def __init__(self, frame: int = 64, bins: int = 33) -> None:
        super().__init__()
        time = torch.arange(frame, dtype=torch.float32)
        angles = 2 * math.pi * torch.arange(bins, dtype=torch.float32)[:, None] * time / frame
        window = torch.hann_window(frame)
        self.register_buffer("cosines", (torch.cos(angles) * window).T.contiguous())
        self.register_buffer("sines", (-torch.sin(angles) * window).T.contiguous())
        self.project = nn.Linear(bins, 16, bias=False)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        real, imaginary = frames @ self.cosines, frames @ self.sines
        return self.project(torch.sqrt(real * real + imaginary * imaginary))


def audio_frames(frames: int, seed: int, frame: int = 64, loudness: float = 0.3) -> torch.Tensor:
    """Speech-like frames: a few harmonics and noise, peak about ``loudness``."""
    generator = torch.Generator().manual_seed(seed)
    time = torch.arange(frame, dtype=torch.float32)
    pitch = 2 + 6 * torch.rand(frames, 1, generator=generator)
    tone = sum(torch.sin(2 * math.pi * k * pitch * time / frame) / k for k in (1, 2, 3))
    noise = 0.1 * torch.randn(frames, frame, generator=generator)
    return loudness * (tone + noise) / 2


class PeakNormalized(nn.Module):
    """Audio frames divided by their peak, then a linear layer: the division is
    singular on a silent frame, and nothing but calibration bounds a peak below (the
    envelope states how much quieter than calibrated a frame may get)."""

    def __init__(self, frame: int = 64) -> None:
        super().__init__()
        self.project = nn.Linear(frame, 16)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        return self.project(frames / frames.abs().amax(-1, keepdim=True))


class VoiceActivity(nn.Module):
    """A voice-activity detector's shape (Silero VAD's): a short-time Fourier transform
    of the waveform by a strided convolution with a windowed cosine and sine basis, the
    magnitude ``sqrt(re^2 + im^2)``, a convolutional encoder, an LSTM over the frames
    and a linear head per frame. A constant stretch of audio (DC) leaves every bin but
    the lowest empty, where 16-bit products of the rounded basis leave signed noise that
    a magnitude turns into a positive bias."""

    def __init__(self, window: int = 128, hop: int = 64, channels: int = 32) -> None:
        super().__init__()
        self.bins = window // 2 + 1
        time = torch.arange(window, dtype=torch.float32)
        angles = 2 * math.pi * torch.arange(self.bins, dtype=torch.float32)[:, None] * time
        angles = angles / window
        hann = torch.hann_window(window)
        basis = torch.cat([torch.cos(angles) * hann, -torch.sin(angles) * hann])
        self.register_buffer("basis", basis[:, None, :].contiguous())
        self.hop = hop
        self.encoder = nn.Sequential(
            nn.Conv1d(self.bins, channels, 3, padding=1),
            nn.ReLU(),
            nn.Conv1d(channels, channels, 3, padding=1),
            nn.ReLU(),
        )
        self.lstm = nn.LSTM(channels, channels, batch_first=True)
        self.head = nn.Linear(channels, 1)

    def spectrum(self, audio: torch.Tensor) -> torch.Tensor:
        """The magnitude of each frame's bins: (batch, bins, frames)."""
        parts = nn.functional.conv1d(audio[:, None, :], self.basis, stride=self.hop)
        real, imaginary = parts[:, : self.bins], parts[:, self.bins :]
        return torch.sqrt(real * real + imaginary * imaginary)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        features = self.encoder(self.spectrum(audio)).transpose(1, 2)
        return self.head(self.lstm(features)[0])


class Spectrum(VoiceActivity):
    """VoiceActivity's front end alone: the magnitudes of the frames' bins."""

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        return self.spectrum(audio)


def speech(clips: int, seed: int, samples: int = 2048, loudness: float = 0.3) -> torch.Tensor:
    """Speech-like waveforms (16 kHz): a pitch of 100-300 Hz with two harmonics, and
    noise; peak about ``loudness``."""
    generator = torch.Generator().manual_seed(seed)
    time = torch.arange(samples, dtype=torch.float32) / 16000
    pitch = 100 + 200 * torch.rand(clips, 1, generator=generator)
    tone = sum(torch.sin(2 * math.pi * k * pitch * time) / k for k in (1, 2, 3))
    noise = 0.1 * torch.randn(clips, samples, generator=generator)
    return loudness * (tone + noise) / 2


def constant_stretches(x: torch.Tensor) -> torch.Tensor:
    """``x`` with the middle third of each row (along the last dim) held at its first
    value, as a stalled sensor or a padded recording holds it: a constant (DC) stretch."""
    x = x.clone()
    start, stop = x.shape[-1] // 3, 2 * x.shape[-1] // 3
    x[..., start:stop] = x[..., start : start + 1]
    return x
