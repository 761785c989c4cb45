#include "shared/ggml_types.h"

#include <string>

namespace ds4 {
namespace {

using A = ActFormat;
using D = DeviceLayout;

struct Row {
  GgmlType type;
  TypeTraits traits;
};

// One row a type: ggml's geometry (ggml-common.h), and for the types ds4
// runs, the activations their products take and how the CUDA backend keeps them.
constexpr Row kRows[] = {
    {GgmlType::F32, {"F32", 1, 4, A::F32, D::as_is}},
    {GgmlType::F16, {"F16", 1, 2, A::F32, D::as_is}},
    {GgmlType::BF16, {"BF16", 1, 2, A::F32, D::as_is}},
    {GgmlType::Q4_0, {"Q4_0", 32, 18, A::Q8_0, D::planes}},
    {GgmlType::Q4_1, {"Q4_1", 32, 20, A::Q8_0, D::planes}},
    {GgmlType::Q5_0, {"Q5_0", 32, 22, A::Q8_0, D::planes}},
    {GgmlType::Q5_1, {"Q5_1", 32, 24, A::Q8_0, D::planes}},
    {GgmlType::Q8_0, {"Q8_0", 32, 34, A::Q8_0, D::q8_split}},
    {GgmlType::Q8_1, {"Q8_1", 32, 36}},
    {GgmlType::Q2_K, {"Q2_K", 256, 84, A::Q8_K, D::planes}},
    {GgmlType::Q3_K, {"Q3_K", 256, 110, A::Q8_K, D::planes}},
    {GgmlType::Q4_K, {"Q4_K", 256, 144, A::Q8_K, D::planes}},
    {GgmlType::Q5_K, {"Q5_K", 256, 176, A::Q8_K, D::planes}},
    {GgmlType::Q6_K, {"Q6_K", 256, 210, A::Q8_K, D::planes}},
    {GgmlType::Q8_K, {"Q8_K", 256, 292}},
    {GgmlType::IQ2_XXS, {"IQ2_XXS", 256, 66}},
    {GgmlType::IQ2_XS, {"IQ2_XS", 256, 74}},
    {GgmlType::IQ3_XXS, {"IQ3_XXS", 256, 98}},
    {GgmlType::IQ1_S, {"IQ1_S", 256, 50}},
    {GgmlType::IQ4_NL, {"IQ4_NL", 32, 18, A::Q8_0, D::planes}},
    {GgmlType::IQ3_S, {"IQ3_S", 256, 110}},
    {GgmlType::IQ2_S, {"IQ2_S", 256, 82}},
    {GgmlType::IQ4_XS, {"IQ4_XS", 256, 136, A::Q8_K, D::planes}},
    {GgmlType::I8, {"I8", 1, 1}},
    {GgmlType::I16, {"I16", 1, 2}},
    {GgmlType::I32, {"I32", 1, 4}},
    {GgmlType::I64, {"I64", 1, 8}},
    {GgmlType::F64, {"F64", 1, 8}},
    {GgmlType::IQ1_M, {"IQ1_M", 256, 56}},
    {GgmlType::TQ1_0, {"TQ1_0", 256, 54}},
    {GgmlType::TQ2_0, {"TQ2_0", 256, 66}},
    {GgmlType::MXFP4, {"MXFP4", 32, 17, A::Q8_0, D::planes}},
};

}  // namespace

const TypeTraits* type_row(GgmlType t) {
  for (const Row& r : kRows)
    if (r.type == t) return &r.traits;
  return nullptr;
}

std::optional<TypeTraits> type_traits(uint32_t type) {
  const TypeTraits* r = type_row(static_cast<GgmlType>(type));
  if (!r) return std::nullopt;
  return *r;
}

uint64_t type_bytes(GgmlType t, uint64_t n) {
  const TypeTraits* r = type_row(t);
  return r ? n / r->block_elems * r->block_bytes : 0;
}

bool type_supported(GgmlType t) {
  const TypeTraits* r = type_row(t);
  return r && r->act != ActFormat::none;
}

std::string_view supported_types() {
  static const std::string names = [] {
    std::string s;
    for (const Row& r : kRows)
      if (r.traits.act != ActFormat::none) s += (s.empty() ? "" : ", ") + std::string(r.traits.name);
    return s;
  }();
  return names;
}

}  // namespace ds4
