/* Event records shared by the BPF side (token_probes.bpf.c) and the Python side
 * (sparseety_prof/events.py mirrors these layouts as numpy dtypes; tests check the sizes).
 *
 * Every record starts with struct ev_hdr. seq is a process-wide counter taken when the record
 * is produced, so the consumer sees a gap whenever a record was lost (reserve failure) and can
 * count it even if the drop counter were lost too.
 */
#ifndef SPARSEETY_EVENTS_H
#define SPARSEETY_EVENTS_H

#ifndef MAX_UB_TOK
#define MAX_UB_TOK 1024          /* rows of a micro-batch copied per step event */
#endif
#ifndef LOGITS_CHUNK
#define LOGITS_CHUNK 16384       /* floats per logits record (64 KiB); the loader sizes it to the
                                    vocabulary (fewer, larger records cost the consumer less) */
#endif
#define MAX_LOGITS_CHUNKS 64     /* LOGITS_CHUNK * 64 floats: vocabularies up to 1M entries */

enum ev_kind {
    EV_DECODE_BEGIN = 1,  /* llama_context::decode entry            ctx = llama_context*          */
    EV_UBATCH = 3,        /* llama_context::process_ubatch entry    struct ev_ubatch              */
    EV_UBATCH_END = 4,    /* process_ubatch return                                                */
    EV_SAMPLE_BEGIN = 5,  /* sampler entry                          a = idx, b = sampler kind     */
    EV_LOGITS = 6,        /* llama_get_logits_ith return inside a sampler call: struct ev_logits  */
    EV_SAMPLE_END = 7,    /* sampler return                         a = token id, b = sampler kind */
    EV_SEQ_RM = 8,        /* llama_memory_seq_rm entry              ctx = memory*, a = seq, b = p0, c = p1 */
    EV_MEM_CLEAR = 9,     /* llama_memory_clear entry               ctx = memory*                 */
};

enum sampler_kind { SAMPLER_LLAMA = 1, SAMPLER_COMMON = 2 };

struct ev_hdr {
    __u64 seq;      /* global record sequence number */
    __u64 ts_ns;    /* bpf_ktime_get_ns(): CLOCK_MONOTONIC */
    __u64 ctx;      /* engine object the record belongs to (llama_context* or memory*) */
    __u32 tid;
    __u16 kind;
    __u16 flags;
};

/* Small records: decode begin, ubatch end, sample begin/end, seq_rm, clear. */
struct ev_small {
    struct ev_hdr h;
    __s32 a;
    __s32 b;
    __s32 c;
    __s32 pad;
    __u64 ptr;
};

#define UB_FLAG_TRUNCATED 1

struct ev_ubatch {
    struct ev_hdr h;
    __u32 n_tokens;             /* rows in the micro-batch */
    __u32 n_copied;             /* rows copied below (min(n_tokens, MAX_UB_TOK)) */
    __u32 row_offset;           /* index of the first copied row: n_tokens - n_copied */
    __u32 pad;                  /* explicit: sizeof must equal the numpy mirror's itemsize */
    __s32 token[MAX_UB_TOK];
    __s32 pos[MAX_UB_TOK];
    __s32 seq[MAX_UB_TOK];      /* first seq id of each row */
    __s8 output[MAX_UB_TOK];    /* row produces logits */
};

struct ev_logits {
    struct ev_hdr h;
    __s32 idx;                  /* argument of llama_get_logits_ith */
    __u32 chunk;                /* chunk number, 0-based */
    __u32 n_vals;               /* valid floats in vals */
    __u32 n_vocab;
    __u32 vals[LOGITS_CHUNK];   /* raw IEEE-754 bits (BPF has no floating point) */
};

#endif
