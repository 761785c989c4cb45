// The AVX-512 table for CPUs with VNNI (Ice Lake, Zen 4 and later): the
// same source as kernels_avx512.cpp, compiled with -mavx512vnni, so that the
// integer products (quants_x86.h, x86_common.h) fold a multiply-add of int16
// pairs and its accumulation into one vpdpwssd, and a block's byte products
// into one vpdpbusd. Integer sums are exact in any grouping: its results are
// the other tables' bit for bit.
#include "worker/cpu/kernels_avx512.cpp"
