"""Generative training with JVP objectives: a Lightning module for :class:`jvpreg.losses.MeanFlowLoss`, one- and
few-step sampling, and an offline quality check of class-conditional samples (a digits classifier)."""
from .lit import MeanFlowModule
from .quality import digits_quality
from .sample import sample

__all__ = ["MeanFlowModule", "digits_quality", "sample"]
