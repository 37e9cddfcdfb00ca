// SPDX-License-Identifier: Apache-2.0
/*
 * fork_driver - calls the probe sites of the kvtrace vLLM fork with known
 * slot arrays and block pairs, and writes its own ground truth (in kvsim's
 * --truth format, so the tests compare both targets the same way).
 *
 *   fork_driver --truth FILE
 *
 * What runs:
 *   - cpu_attn_reshape_and_cache: the vLLM release's own function from its
 *     patched csrc/cpu/cpu_attn.cpp (libvllm_cpu_attn.so), on real CPU tensors of
 *     torch 2.13.0+cpu.  The driver checks that the KV values landed in the
 *     cache, so the op really ran.
 *   - the CUDA ops' probe sites (libfork_cuda_sites.so, see cuda_sites.h),
 *     with host arrays in place of the device tensors.
 *
 * Every step hands the same slot mapping to every layer, as vLLM does: one
 * mapping per step, one write call per layer.  Slots are distinct within a
 * step; negative slots are padding (at the tail, as vLLM pads, and on odd
 * steps one in the middle too).
 */
#include <ATen/ATen.h>

#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <unistd.h>
#include <string>
#include <vector>

#include "cuda_sites.h"

// csrc/cpu/cpu_attn.cpp (its default arguments live there)
void cpu_attn_reshape_and_cache(const at::Tensor& key, const at::Tensor& value,
                                at::Tensor& key_cache, at::Tensor& value_cache,
                                const at::Tensor& slot_mapping,
                                const std::string& isa, const double k_scale,
                                const double v_scale,
                                const std::string& kv_cache_dtype);

namespace {

constexpr int64_t kBlocks = 64;
constexpr int64_t kBlockSize = 32;  // vLLM's CPU backend: a multiple of 32
constexpr int64_t kHeads = 2;
constexpr int64_t kHeadDim = 32;
constexpr int64_t kSteps = 10;
constexpr int64_t kPadTo = 8;
constexpr int64_t kBytesPerBlock = 4096;

enum Op {
  kReshapeAndCache,
  kReshapeAndCacheFlash,
  kConcatAndCacheMla,
  kCpuAttnReshapeAndCache,
  kCopyBlocks,
  kSwapBlocks,
  kSwapBlocksBatch,
  kNumOps
};
const char* const kOpNames[kNumOps] = {
    "reshape_and_cache",          "reshape_and_cache_flash",
    "concat_and_cache_mla",       "cpu_attn_reshape_and_cache",
    "copy_blocks",                "swap_blocks",
    "swap_blocks_batch"};

struct OpTruth {
  uint64_t calls = 0, slots = 0, padding = 0, pairs = 0, bytes = 0;
};

struct Layer {
  Op op;
  uint64_t cache_id = 0;
  std::vector<uint64_t> writes = std::vector<uint64_t>(kBlocks);
  // CPU layers: real tensors; the CUDA sites: a buffer as the cache.
  at::Tensor key_cache, value_cache;
  std::vector<uint8_t> buffer;
};

struct Truth {
  std::vector<Layer> layers;
  std::vector<uint64_t> token_writes = std::vector<uint64_t>(kBlocks);
  std::vector<uint64_t> copy_src = std::vector<uint64_t>(kBlocks);
  std::vector<uint64_t> copy_dst = std::vector<uint64_t>(kBlocks);
  std::vector<uint64_t> swap_out = std::vector<uint64_t>(kBlocks);
  std::vector<uint64_t> swap_in = std::vector<uint64_t>(kBlocks);
  OpTruth ops[kNumOps];
  uint64_t slots_written = 0, padding_skipped = 0, kv_mismatches = 0;
};

uint64_t rng_state = 0x9e3779b97f4a7c15ULL;
uint64_t next_rand() {  // xorshift64*: the same numbers on every run
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return rng_state * 2685821657736338717ULL;
}

// One step's slot mapping: ntok distinct slots, padding after.
std::vector<int64_t> make_slots(int64_t step, int64_t* ntok_out) {
  const int64_t ntok = 1 + static_cast<int64_t>(next_rand() % 90);
  std::vector<bool> used(kBlocks * kBlockSize);
  std::vector<int64_t> slots;
  while (static_cast<int64_t>(slots.size()) < ntok) {
    const int64_t s = static_cast<int64_t>(next_rand() % used.size());
    if (!used[s]) {
      used[s] = true;
      slots.push_back(s);
    }
  }
  if (step % 2 == 1) slots.insert(slots.begin() + ntok / 2, -1);
  while (slots.size() % kPadTo) slots.push_back(-1);
  *ntok_out = ntok;
  return slots;
}

// The value the driver writes for (step, token, head): exact in float.
float kv_value(int64_t step, int64_t token, int64_t head, bool is_value) {
  return static_cast<float>(1 + step * 1000 + token * 4 + head * 2 +
                            (is_value ? 1 : 0));
}

// Counts the mismatches of one cpu_attn call: every live token's values must
// be in its block's region for each head, head_dim times (the layout inside
// the block is the kernel's business).
uint64_t check_cpu_layer(const Layer& layer, const std::vector<int64_t>& slots,
                         int64_t step) {
  uint64_t bad = 0;
  for (size_t t = 0; t < slots.size(); t++) {
    if (slots[t] < 0) continue;
    const int64_t block = slots[t] / kBlockSize;
    for (int64_t h = 0; h < kHeads; h++) {
      for (int is_value = 0; is_value < 2; is_value++) {
        const at::Tensor& cache = is_value ? layer.value_cache : layer.key_cache;
        const float want = kv_value(step, t, h, is_value);
        const int64_t found =
            cache.select(0, block).select(0, h).eq(want).sum().item<int64_t>();
        if (found != kHeadDim) bad++;
      }
    }
  }
  return bad;
}

void write_step(Truth& truth, int64_t step) {
  int64_t ntok = 0;
  const std::vector<int64_t> slots = make_slots(step, &ntok);
  const int64_t n = static_cast<int64_t>(slots.size());
  const uint64_t pad = static_cast<uint64_t>(n - ntok);

  for (int64_t s : slots)
    if (s >= 0) truth.token_writes[s / kBlockSize]++;

  for (Layer& layer : truth.layers) {
    switch (layer.op) {
      case kCpuAttnReshapeAndCache: {
        at::Tensor key = at::empty({n, kHeads, kHeadDim}, at::kFloat);
        at::Tensor value = at::empty({n, kHeads, kHeadDim}, at::kFloat);
        for (int64_t t = 0; t < n; t++)
          for (int64_t h = 0; h < kHeads; h++) {
            key[t][h].fill_(kv_value(step, t, h, false));
            value[t][h].fill_(kv_value(step, t, h, true));
          }
        at::Tensor slot_mapping =
            at::tensor(at::ArrayRef<int64_t>(slots), at::kLong);
        cpu_attn_reshape_and_cache(key, value, layer.key_cache,
                                   layer.value_cache, slot_mapping, "vec", 1.0,
                                   1.0, "auto");
        truth.kv_mismatches += check_cpu_layer(layer, slots, step);
        break;
      }
      case kReshapeAndCache:
        fork_reshape_and_cache(slots.data(), n, kBlockSize,
                               layer.buffer.data(), kBlocks);
        break;
      case kReshapeAndCacheFlash:
        fork_reshape_and_cache_flash(slots.data(), n, kBlockSize,
                                     layer.buffer.data(), kBlocks);
        break;
      case kConcatAndCacheMla:
        fork_concat_and_cache_mla(slots.data(), n, kBlockSize,
                                  layer.buffer.data(), kBlocks);
        break;
      default:
        std::abort();
    }
    for (int64_t s : slots)
      if (s >= 0) layer.writes[s / kBlockSize]++;
    OpTruth& o = truth.ops[layer.op];
    o.calls++;
    o.slots += static_cast<uint64_t>(ntok);
    o.padding += pad;
    truth.slots_written += static_cast<uint64_t>(ntok);
    truth.padding_skipped += pad;
  }
}

// Block pairs (src, dst) as vLLM's block_mapping [npairs, 2] tensor, stored
// row-major (strides 2, 1) or column-major (strides 1, npairs).
void move_blocks(Truth& truth, int kind, Layer& layer, int64_t npairs,
                 bool column_major) {
  std::vector<int64_t> pairs(2 * npairs), storage(2 * npairs);
  for (int64_t i = 0; i < npairs; i++) {
    pairs[2 * i] = static_cast<int64_t>(next_rand() % kBlocks);
    pairs[2 * i + 1] = static_cast<int64_t>(next_rand() % kBlocks);
  }
  const int64_t stride0 = column_major ? 1 : 2;
  const int64_t stride1 = column_major ? npairs : 1;
  for (int64_t i = 0; i < npairs; i++) {
    storage[i * stride0] = pairs[2 * i];
    storage[i * stride0 + stride1] = pairs[2 * i + 1];
  }
  std::vector<uint8_t> host(16);  // the host side of a swap
  void* device = layer.buffer.data();
  void* src = kind == FORK_H2D ? host.data() : device;
  void* dst = kind == FORK_D2H ? host.data() : device;
  fork_swap_blocks(kind, src, dst, kBytesPerBlock, storage.data(), npairs,
                   stride0, stride1);

  OpTruth& o = truth.ops[kind == FORK_D2D ? kCopyBlocks : kSwapBlocks];
  o.calls++;
  o.pairs += static_cast<uint64_t>(npairs);
  o.bytes += static_cast<uint64_t>(npairs * kBytesPerBlock);
  for (int64_t i = 0; i < npairs; i++) {
    if (kind == FORK_D2D) {
      truth.copy_src[pairs[2 * i]]++;
      truth.copy_dst[pairs[2 * i + 1]]++;
    } else if (kind == FORK_D2H) {
      truth.swap_out[pairs[2 * i]]++;
    } else {
      truth.swap_in[pairs[2 * i + 1]]++;
    }
  }
}

void batch_copy(Truth& truth, int64_t count) {
  std::vector<int64_t> src(count), dst(count), sizes(count);
  OpTruth& o = truth.ops[kSwapBlocksBatch];
  for (int64_t i = 0; i < count; i++) {
    src[i] = static_cast<int64_t>(0x10000000 + i * kBytesPerBlock);
    dst[i] = static_cast<int64_t>(0x20000000 + i * kBytesPerBlock);
    sizes[i] = static_cast<int64_t>(1 + next_rand() % kBytesPerBlock);
    o.bytes += static_cast<uint64_t>(sizes[i]);
  }
  fork_swap_blocks_batch(src.data(), dst.data(), sizes.data(), count);
  o.calls++;
  o.pairs += static_cast<uint64_t>(count);
}

void print_array(FILE* f, const std::vector<uint64_t>& a) {
  fputc('[', f);
  for (size_t i = 0; i < a.size(); i++)
    fprintf(f, i ? ", %" PRIu64 : "%" PRIu64, a[i]);
  fputc(']', f);
}

bool write_truth(const Truth& t, const char* path) {
  FILE* f = fopen(path, "w");
  if (!f) return false;
  fprintf(f, "{\n  \"target\": \"fork_driver\",\n  \"pid\": %ld,\n",
          static_cast<long>(getpid()));
  fprintf(f, "  \"block_size\": %" PRId64 ",\n  \"num_blocks\": %" PRId64
             ",\n  \"num_layers\": %zu,\n  \"layers\": [\n",
          kBlockSize, kBlocks, t.layers.size());
  for (size_t l = 0; l < t.layers.size(); l++) {
    fprintf(f, "    {\"layer\": %zu, \"op\": \"%s\", \"cache_id\": %" PRIu64
               ", \"writes\": ",
            l, kOpNames[t.layers[l].op], t.layers[l].cache_id);
    print_array(f, t.layers[l].writes);
    fprintf(f, "}%s\n", l + 1 < t.layers.size() ? "," : "");
  }
  fprintf(f, "  ],\n");
  const std::pair<const char*, const std::vector<uint64_t>*> arrays[] = {
      {"token_writes", &t.token_writes}, {"copy_src", &t.copy_src},
      {"copy_dst", &t.copy_dst},         {"swap_out", &t.swap_out},
      {"swap_in", &t.swap_in}};
  for (const auto& [name, a] : arrays) {
    fprintf(f, "  \"%s\": ", name);
    print_array(f, *a);
    fprintf(f, ",\n");
  }
  fprintf(f, "  \"ops\": {\n");
  for (int op = 0; op < kNumOps; op++) {
    const OpTruth& o = t.ops[op];
    fprintf(f, "    \"%s\": {\"calls\": %" PRIu64 ", \"slots\": %" PRIu64
               ", \"padding\": %" PRIu64 ", \"pairs\": %" PRIu64
               ", \"bytes\": %" PRIu64 "}%s\n",
            kOpNames[op], o.calls, o.slots, o.padding, o.pairs, o.bytes,
            op + 1 < kNumOps ? "," : "");
  }
  fprintf(f, "  },\n  \"slots_written\": %" PRIu64
             ",\n  \"padding_skipped\": %" PRIu64
             ",\n  \"kv_checksum_ok\": %s\n}\n",
          t.slots_written, t.padding_skipped,
          t.kv_mismatches ? "false" : "true");
  return fclose(f) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3 || strcmp(argv[1], "--truth") != 0) {
    fprintf(stderr, "usage: fork_driver --truth FILE\n");
    return 2;
  }
  Truth truth;
  for (Op op : {kCpuAttnReshapeAndCache, kCpuAttnReshapeAndCache,
                kReshapeAndCache, kReshapeAndCacheFlash, kConcatAndCacheMla}) {
    Layer layer;
    layer.op = op;
    if (op == kCpuAttnReshapeAndCache) {
      // [num_blocks, num_kv_heads, block_size, head_size], as vLLM's CPU
      // backend allocates them
      layer.key_cache =
          at::zeros({kBlocks, kHeads, kBlockSize, kHeadDim}, at::kFloat);
      layer.value_cache =
          at::zeros({kBlocks, kHeads, kBlockSize, kHeadDim}, at::kFloat);
      layer.cache_id = reinterpret_cast<uintptr_t>(layer.key_cache.data_ptr());
    } else {
      layer.buffer.resize(64);
      layer.cache_id = reinterpret_cast<uintptr_t>(layer.buffer.data());
    }
    truth.layers.push_back(std::move(layer));
  }

  for (int64_t step = 0; step < kSteps; step++) {
    write_step(truth, step);
    // Moves between steps, on the CUDA sites' caches.
    Layer& layer = truth.layers[2 + step % 3];
    if (step % 3 == 0) move_blocks(truth, FORK_D2D, layer, 3 + step, false);
    if (step % 4 == 1) move_blocks(truth, FORK_D2H, layer, 5, step % 2);
    if (step % 4 == 3) move_blocks(truth, FORK_H2D, layer, 4, true);
    if (step % 5 == 2) batch_copy(truth, step);
  }
  batch_copy(truth, 0);  // an empty batch is a call too

  if (!write_truth(truth, argv[2])) {
    fprintf(stderr, "fork_driver: cannot write %s\n", argv[2]);
    return 1;
  }
  printf("fork_driver: %" PRIu64 " slots written, %" PRIu64
         " padding, kv mismatches %" PRIu64 "\n",
         truth.slots_written, truth.padding_skipped, truth.kv_mismatches);
  return truth.kv_mismatches ? 1 : 0;
}
