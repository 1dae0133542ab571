/* The consumer's walk over the BPF ring buffer (sparseety_prof/bpf_loader.py RingReader):
 * from the consumer position to the producer position, each submitted record is copied into
 * the arena of its size. In Python the walk cost an interpreter's round of work per record,
 * here a few instructions plus the copy.
 *
 * Ring layout (kernel/bpf/ringbuf.c): every record starts with an 8-byte header whose first
 * 32-bit word is the length, with BUSY (reserved, not yet submitted) and DISCARD bits; records
 * are 8-byte aligned; the data pages are mapped twice in a row, so a record never wraps in the
 * mapping. The walk never writes the ring: the caller hands the space back by storing the new
 * consumer position.
 *
 * A size may be taken by reference instead (ref[i] > 0): only its first ref[i] bytes (the
 * record's header fields) are copied, followed by the 64-bit offset in `data` of the bytes past
 * them. The logits records, ~130 KiB per token at a 32k vocabulary, are taken so: their floats
 * are read where they lie, once, by the statistics, and the caller hands the space back only
 * after that (RingReader.release). Copying them cost more CPU than anything else in the walk.
 *
 * Built by build.sh next to librowstats.so; without it the Python walk is used.
 */
#include <stdint.h>
#include <string.h>

#define RW_EXPORT __attribute__((visibility("default")))
#define RW_ABI_VERSION 3
#define RB_BUSY (1u << 31)
#define RB_DISCARD (1u << 30)
#define RB_HDR 8

enum { RW_CAUGHT_UP = 0, RW_BUSY = 1, RW_ARENA_FULL = 2, RW_UNKNOWN_SIZE = 3, RW_LIMIT = 4 };

/* data: the ring's data (double mapping); mask: its size - 1; *cons: consumer position (updated);
 * prod: producer position read by the caller; sizes[n]: record sizes with an arena, dst[i] its
 * buffer, item[i] the bytes of one of its entries (sizes[i], or ref[i] + 8 rounded up to 8 when
 * taken by reference), ref[i] 0 or the header bytes copied by reference, cap[i] its capacity
 * in entries, used[i] entries in it (updated); max_records: stop
 * after this many records (the caller checks the backlog between calls); *stop_size: the
 * size of the record the walk stopped at (ARENA_FULL, UNKNOWN_SIZE). Returns one of the RW_
 * codes. */
RW_EXPORT int sparseety_ring_walk(const uint8_t *data, uint64_t mask, uint64_t *cons, uint64_t prod,
                                  const uint32_t *sizes, int n, uint8_t *const *dst, const uint32_t *item,
                                  const uint32_t *ref, const uint64_t *cap, uint64_t *used,
                                  uint64_t max_records, uint32_t *stop_size) {
    uint64_t c = *cons, k = 0;
    int rc = RW_CAUGHT_UP;
    int last = 0; /* index of the last size seen: records of one size come in runs */
    while (c < prod) {
        if (k >= max_records) {
            rc = RW_LIMIT;
            break;
        }
        const uint8_t *rec = data + (c & mask);
        uint32_t len;
        memcpy(&len, rec, sizeof(len));
        __atomic_thread_fence(__ATOMIC_ACQUIRE); /* the length word is published last */
        if (len & RB_BUSY) {
            rc = RW_BUSY;
            break;
        }
        uint32_t size = len & ~(RB_BUSY | RB_DISCARD);
        if (!(len & RB_DISCARD)) {
            int i = last;
            if (i >= n || sizes[i] != size)
                for (i = 0; i < n && sizes[i] != size; i++)
                    ;
            if (i == n) {
                *stop_size = size;
                rc = RW_UNKNOWN_SIZE;
                break;
            }
            if (used[i] >= cap[i]) {
                *stop_size = size;
                rc = RW_ARENA_FULL;
                break;
            }
            uint8_t *out = dst[i] + used[i] * (uint64_t)item[i];
            if (ref[i]) { /* the caller keeps ref[i] < sizes[i] */
                uint64_t at = (c & mask) + RB_HDR + ref[i]; /* where the rest lies in `data` */
                memcpy(out, rec + RB_HDR, ref[i]);
                memcpy(out + item[i] - sizeof(at), &at, sizeof(at));
            } else {
                memcpy(out, rec + RB_HDR, size);
            }
            used[i]++;
            last = i;
        }
        c += ((uint64_t)size + RB_HDR + 7) & ~(uint64_t)7;
        k++;
    }
    *cons = c;
    return rc;
}

RW_EXPORT int sparseety_ring_walk_abi(void) { return RW_ABI_VERSION; }
