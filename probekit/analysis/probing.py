"""Linear probes per residual depth with grouped cross-validation (App. F "Probe construction").

The latent-feedback paper (Sec. 4.4, App. F) records, at the final shared colon of every
example, the residual stream at each depth and fits "an L2-regularized linear
classifier at each residual-stream depth using four-fold grouped cross-validation".
``DepthProbe`` does exactly that (SEMANTICS.md, "Probing")::

    X: [n_examples, n_depths, d_model]   residual at the final token, depth r = 0 .. L
    y: [n_examples]                      class of each example (e.g. Dataset.labels)
    groups: [n_examples]                 Dataset.groups; a group is never split

    probe = DepthProbe().fit(X, y, groups)
    probe.accuracy_mean_[r]              mean test-fold accuracy at residual depth r

Per depth and fold: standardise the features on the training fold only (residual
streams have a few huge-magnitude dimensions that would otherwise dominate the L2
penalty and slow lbfgs), then fit ``LogisticRegression(C=1.0, solver="lbfgs")``, an
L2 penalty of strength ``1 / C`` on standardised features. The same folds are used at
every depth, so depths are compared on identical splits. BLAS is held to one thread
during the fits: each fit is tiny, and threading it costs more than it saves
(docs/state-tracking.md, "Cost").

Splitting: ``StratifiedGroupKFold(shuffle=True, random_state=seed)``. Grouping keeps a
numeral pair / scratch context / register schedule wholly in train or in test;
stratification keeps each test fold's class balance close to the whole set's, so the
chance level is about the same in every fold even when groups differ in label mix
(plain ``GroupKFold`` only balances fold sizes). The task generators balance labels
within each group, so for them every test fold is exactly balanced.

Chance (``chance_``): in each test fold, the fraction of the fold's majority class,
averaged over folds -- the best accuracy any constant prediction could reach on those
folds. A probe on features identical across examples (depth 0 under standard prefill,
where every example ends with the same token) predicts one class and stays at or below it.
"""

from __future__ import annotations

from numbers import Integral
from typing import Any

import numpy as np
from sklearn.base import BaseEstimator
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import StratifiedGroupKFold
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.utils.validation import check_is_fitted
from threadpoolctl import threadpool_limits

Fold = tuple[np.ndarray, np.ndarray]


def grouped_folds(y: np.ndarray, groups: np.ndarray, n_folds: int = 4, seed: int = 0) -> list[Fold]:
    """(train indices, test indices) of ``n_folds`` folds that never split a group.

    Raises:
        ValueError: if there are fewer distinct groups than ``n_folds`` or a test fold
            would be empty.
    """
    y, groups = np.asarray(y), np.asarray(groups)
    n_groups = np.unique(groups).size
    if n_groups < n_folds:
        raise ValueError(
            f"groups has {n_groups} distinct groups but n_folds={n_folds}; "
            f"grouped cross-validation needs at least n_folds groups"
        )
    splitter = StratifiedGroupKFold(n_splits=n_folds, shuffle=True, random_state=seed)
    folds = [(train, test) for train, test in splitter.split(np.zeros(len(y)), y, groups)]
    if any(test.size == 0 for _, test in folds):
        raise ValueError(f"n_folds={n_folds} leaves a test fold empty for these groups")
    return folds


class DepthProbe(BaseEstimator):
    """One L2 logistic-regression probe per residual depth, scored by grouped k-fold CV.

    Args:
        C: inverse L2 strength of ``LogisticRegression`` (on standardised features).
        n_folds: number of grouped cross-validation folds (paper: 4).
        max_iter: lbfgs iteration limit per fit.
        seed: seed of the fold assignment.
        standardize: standardise features on each training fold before fitting.

    Fitted attributes:
        accuracy_mean_: ``[n_depths]`` mean test accuracy over folds.
        accuracy_std_: ``[n_depths]`` standard deviation over folds (ddof=0, as
            numpy/scikit-learn report it).
        fold_accuracies_: ``[n_depths, n_folds]`` test accuracy of every fold.
        chance_: majority-class rate of each test fold, averaged over folds.
        n_depths_: number of depths probed.
        classes_: the classes of ``y``.
        folds_: the (train, test) index arrays used at every depth.
    """

    def __init__(
        self,
        C: float = 1.0,
        n_folds: int = 4,
        max_iter: int = 1000,
        seed: int = 0,
        standardize: bool = True,
    ) -> None:
        self.C = C
        self.n_folds = n_folds
        self.max_iter = max_iter
        self.seed = seed
        self.standardize = standardize

    def _check_params(self) -> None:
        if not self.C > 0:
            raise ValueError(f"C must be > 0; got {self.C}")
        if not (isinstance(self.n_folds, Integral) and self.n_folds >= 2):
            raise ValueError(f"n_folds must be an integer >= 2; got {self.n_folds!r}")
        if not (isinstance(self.max_iter, Integral) and self.max_iter >= 1):
            raise ValueError(f"max_iter must be an integer >= 1; got {self.max_iter!r}")

    def _classifier(self) -> Any:
        logreg = LogisticRegression(C=self.C, solver="lbfgs", max_iter=self.max_iter)
        return make_pipeline(StandardScaler(), logreg) if self.standardize else logreg

    def fit(self, X: Any, y: Any, groups: Any) -> DepthProbe:
        """Fit and score a probe at every depth of ``X [n_examples, n_depths, d_model]``.

        Raises:
            ValueError: naming ``X``, ``y``, ``groups`` or a parameter that is wrong.
        """
        self._check_params()
        X = np.asarray(X)
        if X.ndim != 3:
            raise ValueError(
                f"X must have shape [n_examples, n_depths, d_model]; got shape {X.shape}"
            )
        y, groups = np.asarray(y), np.asarray(groups)
        for name, arr in (("y", y), ("groups", groups)):
            if arr.shape != (X.shape[0],):
                raise ValueError(
                    f"{name} must have shape [n_examples] = ({X.shape[0]},); got {arr.shape}"
                )
        self.classes_ = np.unique(y)
        if self.classes_.size < 2:
            raise ValueError(
                f"y has a single class {self.classes_.tolist()}; a probe needs at least two"
            )
        self.folds_ = grouped_folds(y, groups, self.n_folds, self.seed)
        self.n_depths_ = X.shape[1]
        self.n_groups_ = np.unique(groups).size
        self.fold_accuracies_ = np.zeros((self.n_depths_, self.n_folds))
        # One BLAS thread: at a few hundred examples, threading costs ~10x the arithmetic.
        with threadpool_limits(limits=1):
            for depth in range(self.n_depths_):
                features = X[:, depth].astype(np.float64)
                for k, (train, test) in enumerate(self.folds_):
                    clf = self._classifier().fit(features[train], y[train])
                    self.fold_accuracies_[depth, k] = clf.score(features[test], y[test])
        self.accuracy_mean_ = self.fold_accuracies_.mean(axis=1)
        self.accuracy_std_ = self.fold_accuracies_.std(axis=1)
        self.chance_ = float(np.mean([
            np.unique(y[test], return_counts=True)[1].max() / test.size
            for _, test in self.folds_
        ]))
        return self

    def to_dict(self) -> dict[str, Any]:
        """The parameters and results as JSON-serialisable Python types."""
        check_is_fitted(self, "accuracy_mean_")
        return {
            "params": self.get_params(),
            "splitter": "StratifiedGroupKFold",
            "n_depths": int(self.n_depths_),
            "n_groups": int(self.n_groups_),
            "classes": self.classes_.tolist(),
            "chance": self.chance_,
            "accuracy_mean": self.accuracy_mean_.tolist(),
            "accuracy_std": self.accuracy_std_.tolist(),
            "fold_accuracies": self.fold_accuracies_.tolist(),
        }
