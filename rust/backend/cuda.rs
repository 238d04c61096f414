//! CUDA driver backend (placeholder until the driver backend lands).
