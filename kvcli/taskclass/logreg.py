"""L2-regularised binary logistic regression in numpy, fitted by Newton's method (deterministic, no scipy).

There are far fewer examples (hundreds) than n-gram features (thousands), so each Newton step solves its
d x d system through the n x n Woodbury form: (Z'SZ/n + lam I)^-1 g = (g - Z'S^(1/2) (n lam I +
S^(1/2) ZZ' S^(1/2))^-1 S^(1/2) Z g) / lam. The bias is an extra constant column regularised like the
weights (as liblinear does); the classes are balanced, so that costs nothing.
"""
from __future__ import annotations

import numpy as np


def _sigmoid(z: np.ndarray) -> np.ndarray:
    out = np.empty_like(z)
    pos = z >= 0
    out[pos] = 1.0 / (1.0 + np.exp(-z[pos]))
    ez = np.exp(z[~pos])
    out[~pos] = ez / (1.0 + ez)
    return out


def _loss(Z: np.ndarray, y: np.ndarray, theta: np.ndarray, lam: float) -> float:
    f = Z @ theta
    # log(1 + exp(f)) - y f, written to stay finite for large |f|
    return float(np.mean(np.logaddexp(0.0, f) - y * f) + 0.5 * lam * theta @ theta)


def with_bias(X: np.ndarray, intercept: bool = True) -> np.ndarray:
    X = X.astype(np.float64)
    return np.hstack([X, np.ones((X.shape[0], 1))]) if intercept else X


def fit(X: np.ndarray, y: np.ndarray, lam: float, tol: float = 1e-10, max_iter: int = 100, intercept: bool = True,
        Z: np.ndarray | None = None, K: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """Weights and bias minimising mean log-loss + lam/2 (|w|^2 + b^2); y in {0, 1}. intercept=False: b = 0.

    `Z` = with_bias(X, intercept) and `K` = Z Z' may be passed in when several strengths are fitted on the
    same data.
    """
    n = X.shape[0]
    Z = with_bias(X, intercept) if Z is None else Z
    y = y.astype(np.float64)
    K = Z @ Z.T if K is None else K
    theta = np.zeros(Z.shape[1])
    for _ in range(max_iter):
        f = Z @ theta
        p = _sigmoid(f)
        g = Z.T @ (p - y) / n + lam * theta
        if float(np.max(np.abs(g))) < tol:
            break
        s = np.sqrt(p * (1.0 - p))
        M = n * lam * np.eye(n) + (s[:, None] * K) * s[None, :]
        step = (g - Z.T @ (s * np.linalg.solve(M, s * (Z @ g)))) / lam
        # backtracking keeps every step a descent step (Newton alone can overshoot early on)
        t, base = 1.0, _loss(Z, y, theta, lam)
        while t > 1e-8 and _loss(Z, y, theta - t * step, lam) > base - 1e-4 * t * float(g @ step):
            t *= 0.5
        theta = theta - t * step
    return (theta[:-1], float(theta[-1])) if intercept else (theta, 0.0)


def predict_proba(X: np.ndarray, w: np.ndarray, b: float) -> np.ndarray:
    return _sigmoid(X @ w + b)
