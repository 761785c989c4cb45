#pragma once
/// What the model store's three parts share: model_store.cpp loads segments,
/// segment_reader.cpp attaches them, segment_sweep.cpp removes old ones.
/// Not for code outside them.

#include <cstdint>
#include <string>

#include "shared/model_store.h"

namespace ds4::store {

/// 2 MiB pages: a CPU decode step streams every weight once, and from 2 MiB
/// pages it runs up to ~1.2x faster than from 4 KiB ones (fewer TLB misses
/// and page walks). Shared memory has them only where the machine allows it
/// (shmem_enabled, or a tmpfs mounted huge=), which Debian does not by
/// default; MADV_COLLAPSE (Linux 6.1) makes them for a range of a memfd or a
/// tmpfs file whatever those settings say (but "deny"), without privileges.
/// A 2 MiB page maps only where the virtual address and the file offset agree
/// modulo 2 MiB: every mapping of a segment starts on a 2 MiB boundary.
inline constexpr uint64_t kHugePage = uint64_t(2) << 20;

/// Maps [0, bytes) of fd at a 2 MiB boundary (see kHugePage); MAP_FAILED with
/// errno set when it cannot. Unmapped with munmap(p, bytes) like any mapping.
void* map_segment(int fd, uint64_t bytes, int prot);

/// CLOCK_REALTIME in nanoseconds.
int64_t realtime_ns();

/// The loader holds an exclusive flock on the segment for the whole load; the
/// kernel drops it when the loader dies, so a free lock means nobody is loading.
bool loader_lock_held(int fd);

/// "memfd segment '<name>'" or "shared-memory segment '<name>'", for messages.
std::string segment_label(const std::string& handle);

/// The identity a segment's header records.
Identity header_identity(const SegmentHeader& h);

}  // namespace ds4::store
