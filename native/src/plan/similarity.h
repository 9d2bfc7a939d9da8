// Cosine similarity of float32 rows in double, shared by the merging policies (d2o, spindlekv).
// Each product of two floats is exact in double, and the sum runs over the dimensions in index
// order from 0.0, so a contracted multiply-add gives the same result: the torch twins
// (kvcli/reference/policies/d2o.py: dots, sq_norms, cosine) compute bit-identical values.
#pragma once

namespace kvcli {

inline double dot(const float * a, const float * b, int d) {
    double acc = 0.0;
    for (int i = 0; i < d; i++) acc = acc + static_cast<double>(a[i]) * static_cast<double>(b[i]);
    return acc;
}

inline double sq_norm(const float * a, int d) { return dot(a, a, d); }

// dot / (norm_a * norm_b), with the norms already square-rooted; 0 when either vector is zero.
inline double cosine(double dot_ab, double norm_a, double norm_b) {
    const double den = norm_a * norm_b;
    return den > 0.0 ? dot_ab / den : 0.0;
}

} // namespace kvcli
