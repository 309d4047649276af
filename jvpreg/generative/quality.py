"""Offline quality of class-conditional digit samples: a classifier's accuracy and confidence on them, and their
distance to the nearest training image (memorisation check), each next to the same numbers for real test images.

The classifier is scikit-learn's multinomial ``LogisticRegression`` on the raw pixels in ``[0, 1]``, fitted on the
training split only (implementation choice: deterministic, a second to fit, ~96% on the real test split).
"""
from __future__ import annotations

from typing import Dict, Mapping, Optional

import numpy as np
import torch

__all__ = ["digits_classifier", "digits_quality"]


def digits_classifier(train_x: torch.Tensor, train_y: torch.Tensor):
    """A ``LogisticRegression`` fitted on flattened ``train_x`` in ``[0, 1]``."""
    from sklearn.linear_model import LogisticRegression

    clf = LogisticRegression(max_iter=5000)
    clf.fit(train_x.flatten(1).double().numpy(), train_y.numpy())
    return clf


def _scores(clf, x: torch.Tensor, y: torch.Tensor, train_flat: torch.Tensor) -> Dict[str, float]:
    flat = x.flatten(1).double()
    prob = clf.predict_proba(flat.numpy())
    pred = prob.argmax(1)
    yy = y.numpy()
    nn_dist = torch.cdist(flat, train_flat).min(1).values
    return {"acc": float((pred == yy).mean()), "confidence": float(prob.max(1).mean()),
            "p_label": float(prob[np.arange(len(yy)), yy].mean()), "nn_dist": float(nn_dist.mean()),
            "nn_dist_median": float(nn_dist.median())}


def digits_quality(samples: Mapping[str, torch.Tensor], labels: torch.Tensor, train_x: torch.Tensor,
                   train_y: torch.Tensor, test_x: torch.Tensor, test_y: torch.Tensor,
                   clf: Optional[object] = None) -> Dict[str, Dict[str, float]]:
    """``{name: {acc, confidence, p_label, nn_dist, nn_dist_median}}`` for each sample set and for ``"real test"``.

    ``acc``: the classifier's accuracy against the labels the samples were drawn for; ``confidence``: its mean
    top probability; ``p_label``: its mean probability of the intended label; ``nn_dist``: mean L2 distance (pixels
    in ``[0, 1]``) to the nearest training image.
    """
    clf = clf if clf is not None else digits_classifier(train_x, train_y)
    train_flat = train_x.flatten(1).double()
    out = {name: _scores(clf, x, labels, train_flat) for name, x in samples.items()}
    out["real test"] = _scores(clf, test_x, test_y, train_flat)
    return out
