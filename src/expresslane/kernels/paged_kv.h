// One layer's paged KV cache as the C++ code reads and writes it, in place: float32 or bf16
// [2, Hkv, slots, D]; or FP8 KV: E4M3 bytes [2, Hkv, slots, D] + float16 scales
// [2, Hkv, slots, 1]; or FP4 KV: E2M1 codes [2, Hkv, slots, D/2] + E4M3 scales per 16 values
// [2, Hkv, slots, D/16] (models/kv_store.py PlainKV, Bf16KV, Fp8KV, Fp4KV: native()).
//
// The Python stores' `write` (models/kv_store.py) is the reference for the quantization:
// write_row computes the same scales and rounds the same way, byte for byte
// (tests/test_kv_store.py checks it through the module's write_kv).
#pragma once
#include <torch/extension.h>

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common.h"
#include "constants.h"
#include "widen.h"

namespace expresslane {

// The E2M1 code of v as quant/formats.py e2m1_encode: nearest value, ties to the even code.
inline uint8_t e2m1_code(float v) {
  static constexpr float mid[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  const float mag = std::fabs(v);
  uint8_t index = 0;
  for (int k = 0; k < 7; ++k) index += (k % 2) ? (mag >= mid[k]) : (mag > mid[k]);
  return index | (std::signbit(v) ? 8 : 0);
}

struct PagedKV {
  std::vector<torch::Tensor> kv;
  KVKind kind = KVKind::kPlain;
  int64_t Hkv = 0, D = 0, S = 0;  // kv heads, head dim, slots
  uint8_t* values = nullptr;  // kv[0]'s data
  const void* scales = nullptr;  // kv[1]'s data (FP8, FP4)

  PagedKV() = default;
  PagedKV(std::vector<torch::Tensor> tensors, int64_t kind_, int64_t head_dim)
      : kind(static_cast<KVKind>(kind_)), D(head_dim) {
    const bool unscaled = kind == KVKind::kPlain || kind == KVKind::kBf16;
    TORCH_CHECK(tensors.size() == (unscaled ? 1u : 2u) && kind_ >= value(KVKind::kPlain) &&
                    kind_ <= value(KVKind::kBf16),
                "kv: [cache] or [values, scales]");
    const auto& v = tensors[0];
    const auto dtype = kind == KVKind::kPlain ? torch::kFloat32 : kind == KVKind::kBf16 ? torch::kBFloat16 : torch::kUInt8;
    TORCH_CHECK(v.is_contiguous() && v.dim() == 4 && v.size(0) == 2 &&
                    v.size(3) == (kind == KVKind::kFp4 ? D / 2 : D) && v.dtype() == dtype,
                "kv values: contiguous [2, Hkv, slots, D] (D/2 bytes for FP4)");
    TORCH_CHECK(unscaled ||
                    (tensors[1].is_contiguous() && tensors[1].size(2) == v.size(2) &&
                     tensors[1].dtype() == (kind == KVKind::kFp8 ? torch::kFloat16 : torch::kUInt8) &&
                     tensors[1].size(3) == (kind == KVKind::kFp8 ? 1 : D / 16)),
                "kv scales: float16 [2, Hkv, slots, 1] (FP8) or E4M3 bytes [2, Hkv, slots, D/16] (FP4)");
    kv = {v, unscaled ? torch::Tensor() : tensors[1]};
    Hkv = v.size(1);
    S = v.size(2);
    values = static_cast<uint8_t*>(v.data_ptr());  // raw pointers: row() runs ~10^5 times a step
    if (!unscaled) scales = kv[1].data_ptr();
  }
  int64_t slots() const { return S; }

  // Row `slot` of kv head h of K (which 0) or V (which 1): in place for a float32 cache, else
  // widened or dequantized into buf.
  const float* row(int64_t which, int64_t h, int64_t slot, float* buf) const {
    const int64_t r = (which * Hkv + h) * S + slot;
    if (kind == KVKind::kPlain) return reinterpret_cast<const float*>(values) + r * D;
    if (kind == KVKind::kBf16) {
      widen_bf16(reinterpret_cast<const uint16_t*>(values) + r * D, buf, D);
      return buf;
    }
    if (kind == KVKind::kFp8) {
      widen_fp8(values + r * D, static_cast<float>(static_cast<const c10::Half*>(scales)[r]), buf, D);
    } else {
      widen_fp4(values + r * (D / 2), static_cast<const uint8_t*>(scales) + r * (D / 16), buf, D);
    }
    return buf;
  }

  // Row `slot` of kv head h of K (which 0) or V (which 1) of an FP8 cache, where it lies; its
  // scale times 2^8 into *scale (the attention reads the bytes as their values / 2^8).
  const uint8_t* fp8_row(int64_t which, int64_t h, int64_t slot, float* scale) const {
    const int64_t r = (which * Hkv + h) * S + slot;
    *scale = kE4M3HalfUnit * static_cast<float>(static_cast<const c10::Half*>(scales)[r]);
    return values + r * D;
  }

  // Row `slot` of kv head h of K (which 0) or V (which 1) of a bf16 cache, where it lies.
  const uint16_t* bf16_row(int64_t which, int64_t h, int64_t slot) const {
    return reinterpret_cast<const uint16_t*>(values) + ((which * Hkv + h) * S + slot) * D;
  }

  // Stores the D floats at src as row `slot` of kv head h of K (which 0) or V (which 1),
  // encoded as the store's write encodes it. Writes the cache's tensors, not this struct.
  void write_row(int64_t which, int64_t h, int64_t slot, const float* src) const {
    const int64_t r = (which * Hkv + h) * S + slot;
    if (kind == KVKind::kPlain) {
      std::memcpy(kv[0].data_ptr<float>() + r * D, src, D * sizeof(float));
    } else if (kind == KVKind::kBf16) {
      c10::BFloat16* dst = kv[0].data_ptr<c10::BFloat16>() + r * D;
      for (int64_t i = 0; i < D; ++i) dst[i] = c10::BFloat16(src[i]);  // to nearest, ties even
    } else if (kind == KVKind::kFp8) {
      write_fp8(r, src);
    } else {
      write_fp4(r, src);
    }
  }

 private:
  // As Fp8KV.write: scale = half(max(amax / 448, 2^-24)), values e4m3(x / scale).
  void write_fp8(int64_t r, const float* src) const {
    float amax = 0.0f;
    for (int64_t i = 0; i < D; ++i) amax = std::max(amax, std::fabs(src[i]));
    const c10::Half scale(std::max(amax / 448.0f, 0x1p-24f));
    kv[1].data_ptr<c10::Half>()[r] = scale;
    uint8_t* dst = kv[0].data_ptr<uint8_t>() + r * D;
    for (int64_t i = 0; i < D; ++i) dst[i] = c10::Float8_e4m3fn(src[i] / static_cast<float>(scale)).x;
  }

  // As Fp4KV.write: per 16 values, scale = e4m3(min(amax / 6, 448)), codes e2m1(x / scale)
  // (0 where the scale is 0).
  void write_fp4(int64_t r, const float* src) const {
    uint8_t* codes = kv[0].data_ptr<uint8_t>() + r * (D / 2);
    uint8_t* block_scales = kv[1].data_ptr<uint8_t>() + r * (D / 16);
    for (int64_t blk = 0; blk < D / 16; ++blk) {
      const float* x = src + 16 * blk;
      float amax = 0.0f;
      for (int i = 0; i < 16; ++i) amax = std::max(amax, std::fabs(x[i]));
      const c10::Float8_e4m3fn scale(std::min(amax / 6.0f, 448.0f));
      block_scales[blk] = scale.x;
      const float s = static_cast<float>(scale);
      for (int i = 0; i < 16; i += 2)
        codes[8 * blk + i / 2] = e2m1_code(s > 0 ? x[i] / s : 0.0f) | (e2m1_code(s > 0 ? x[i + 1] / s : 0.0f) << 4);
    }
  }
};

}  // namespace expresslane
