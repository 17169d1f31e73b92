"""Typed, framework-neutral architecture configs shared by the PyTorch and Flax models."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from ddm.deploy.limits import MAX_NETWORK_BLOCKS


class ConfigError(ValueError):
    """An architecture config is malformed: unknown keys, wrong types or impossible sizes."""


@dataclass(frozen=True)
class UNetConfig:
    """A conditional UNet over images of layout ``(B, C, H, W)``.

    ``channel_mults`` gives one level per entry (``base_channels * mult`` channels); every
    level but the last halves the resolution. Labels index a learned embedding of
    ``num_classes`` rows; time enters through sinusoidal features of ``time_features`` dims.
    """

    image_size: int = 16
    in_channels: int = 1
    base_channels: int = 32
    channel_mults: tuple[int, ...] = (1, 2)
    num_res_blocks: int = 1
    num_classes: int = 10
    time_features: int = 64
    norm_groups: int = 8

    def __post_init__(self) -> None:
        for name in ("image_size", "in_channels", "base_channels", "num_res_blocks",
                     "num_classes", "time_features", "norm_groups"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"UNetConfig.{name} must be a positive integer, got {value!r}")
        mults = tuple(self.channel_mults)
        if not mults or any(not isinstance(m, int) or m < 1 for m in mults):
            raise ConfigError(f"UNetConfig.channel_mults must be positive integers, got {mults!r}")
        object.__setattr__(self, "channel_mults", mults)
        if len(mults) * self.num_res_blocks > MAX_NETWORK_BLOCKS:
            raise ConfigError(f"UNetConfig: {len(mults)} levels of {self.num_res_blocks} "
                              f"residual blocks; a network has at most {MAX_NETWORK_BLOCKS}")
        if self.image_size % (2 ** (len(mults) - 1)):
            raise ConfigError(
                f"image_size {self.image_size} is not divisible by 2**{len(mults) - 1} "
                f"for {len(mults)} levels")
        if self.time_features % 2:
            raise ConfigError(f"time_features must be even, got {self.time_features}")
        for width in self.level_channels:
            if width % self.norm_groups:
                raise ConfigError(
                    f"level width {width} is not divisible by norm_groups {self.norm_groups}")

    @property
    def level_channels(self) -> tuple[int, ...]:
        return tuple(self.base_channels * m for m in self.channel_mults)

    @property
    def embed_dim(self) -> int:
        """Width of the joint time + class embedding fed to every residual block."""
        return 4 * self.base_channels

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["channel_mults"] = list(self.channel_mults)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "UNetConfig":
        return config_from_dict(cls, d)


@dataclass(frozen=True)
class RouterNetworkConfig:
    """The router network's architecture: a small CNN classifier of ``(x_t, t, y)`` into
    ``num_experts`` partition logits (not ``router.yaml``, which is ``RouterConfigFile``)."""

    image_size: int = 16
    in_channels: int = 1
    channels: tuple[int, ...] = (16, 32)
    num_experts: int = 2
    num_classes: int = 10
    time_features: int = 32
    use_labels: bool = True

    def __post_init__(self) -> None:
        for name in ("image_size", "in_channels", "num_experts", "num_classes", "time_features"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(
                    f"RouterNetworkConfig.{name} must be a positive integer, got {value!r}")
        chans = tuple(self.channels)
        if not chans or any(not isinstance(c, int) or c < 1 for c in chans):
            raise ConfigError(
                f"RouterNetworkConfig.channels must be positive integers, got {chans!r}")
        if len(chans) > MAX_NETWORK_BLOCKS:
            raise ConfigError(f"RouterNetworkConfig: {len(chans)} levels; a network has at "
                              f"most {MAX_NETWORK_BLOCKS} blocks")
        object.__setattr__(self, "channels", chans)
        if self.time_features % 2:
            raise ConfigError(f"time_features must be even, got {self.time_features}")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["channels"] = list(self.channels)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RouterNetworkConfig":
        return config_from_dict(cls, d)


#: Named UNet sizes. ``digits-small`` is the shipped CPU demo; ``mnist-small`` the MNIST DDM's
#: experts and monolith (MNIST padded to 32x32, 3 levels 16 -> 32 -> 32: 0.18 M parameters,
#: 0.7 MB of float32, so each shipped expert stays small; a training step of 128 images costs
#: ~0.6 CPU-s, against ~2.4 at twice the width, which put the DDM's ~30k steps out of a CPU's
#: reach); ``reference`` matches the reference demo's experts (3 levels 64 -> 128 -> 256 at
#: 32x32, 26 MB); ``smoke`` is for tests.
UNET_CONFIGS: dict[str, UNetConfig] = {
    "smoke": UNetConfig(image_size=8, base_channels=8, channel_mults=(1, 2), num_res_blocks=1,
                        time_features=16, norm_groups=4),
    "digits-small": UNetConfig(image_size=16, base_channels=24, channel_mults=(1, 2),
                               num_res_blocks=1, time_features=64, norm_groups=8),
    "mnist-small": UNetConfig(image_size=32, base_channels=16, channel_mults=(1, 2, 2),
                              num_res_blocks=1, time_features=64, norm_groups=8),
    "reference": UNetConfig(image_size=32, base_channels=64, channel_mults=(1, 2, 4),
                            num_res_blocks=1, time_features=128, norm_groups=32),
}


def unet_config(name: str) -> UNetConfig:
    """Look up a named config, naming the known ones when ``name`` is not among them."""
    try:
        return UNET_CONFIGS[name]
    except KeyError:
        raise ConfigError(
            f"unknown UNet config {name!r}; known: {', '.join(sorted(UNET_CONFIGS))}") from None


def config_from_dict(cls: type, d: Mapping[str, Any]) -> Any:
    """Config dataclass ``cls`` from ``d`` (parsed JSON, its lists as tuples): a
    :class:`ConfigError` naming what is wrong, never a ``TypeError``, where ``d`` is not an
    object, holds a key ``cls`` does not know or lacks one it needs."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"{cls.__name__} must be a mapping, got {type(d).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(map(str, set(d) - known))
    if unknown:
        raise ConfigError(f"{cls.__name__} has unknown keys: {', '.join(unknown)}")
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{cls.__name__}: {exc}") from None
