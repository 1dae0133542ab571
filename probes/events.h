/* Event records shared by the BPF side (token_probes.bpf.c) and the Python side
 * (sparseety_prof/capture/events.py mirrors these layouts as numpy dtypes; tests check the sizes).
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
#define UB_SMALL_TOK 16          /* a micro-batch of up to this many rows (a decode step, a server
                                    step over a few slots) is sent as struct ev_ubatch_s */
#ifndef LOGITS_CHUNK
#define LOGITS_CHUNK 65536       /* most floats per logits record (256 KiB); the loader sizes it to
                                    the vocabulary: one record per row up to 65,536 entries (each
                                    record costs the consumer a handler call, and a row split over
                                    records a copy to put it together) */
#endif
#define MAX_LOGITS_CHUNKS 64     /* LOGITS_CHUNK * 64 floats: vocabularies up to 4M entries */

enum ev_kind { /* where the record is made, and its struct (ev_small's fields: the table there) */
    EV_DECODE_BEGIN = 1,  /* llama_context::decode entry                            ev_small        */
    EV_UBATCH = 3,        /* llama_context::process_ubatch entry                    ev_ubatch       */
    EV_UBATCH_END = 4,    /* process_ubatch return                                  ev_small        */
    EV_SAMPLE_BEGIN = 5,  /* sampler entry                                          ev_small        */
    EV_LOGITS = 6,        /* llama_get_logits_ith return inside a sampler call      ev_logits       */
    EV_SAMPLE_END = 7,    /* sampler return                                         ev_small        */
    EV_SEQ_RM = 8,        /* llama_memory_seq_rm entry                              ev_small        */
    EV_MEM_CLEAR = 9,     /* llama_memory_clear entry                               ev_small        */
    EV_TENSOR = 10,       /* a routing tensor copied at a graph node                ev_tensor_{s,l} */
    EV_ACT = 11,          /* activation counts of one thread's rows of a GLU node   ev_act          */
    EV_ATTN = 12,         /* attention mask of one layer, counted per output row    ev_attn         */
    EV_ACT_MASK = 13,     /* ev_act plus the zero mask bits (--capture-masks)       ev_act_mask     */
    EV_STEP_AGG = 14,     /* routing and activation totals of a one-row micro-batch ev_step_agg     */
    /* ---- serving context (server_probes.bpf.c): llama-server's request -> task -> slot chain */
    EV_HTTP_READ = 15,    /* bytes a server thread received on a socket             ev_http         */
    EV_TASK_POST = 16,    /* server_queue::post entry                               ev_small        */
    EV_SLOT_LAUNCH = 17,  /* launch_slot_with_task entry                            ev_small        */
    EV_SLOT_CHILD = 18,   /* launch_slots_with_parent_task entry                    ev_small        */
    EV_SLOT_RELEASE = 19, /* server_slot::release entry                             ev_small        */
    EV_SLOT_TOKEN = 20,   /* process_token entry                                    ev_small        */
    /* ---- head sampling in the probes (-DHEAD_KEEP_BELOW; token_probes.bpf.c head_keeps) */
    EV_HEAD_DRAW = 21,    /* a sequence's draw, where a sampler read its row       ev_small        */
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

/* Small records (emit_small in token_probes.bpf.c, server_probes.bpf.c). What a, b, c and ptr (and
 * h.ctx) hold depends on h.kind; the numpy mirror keeps the names a, b, c, and the consumer reads
 * them by this table (fields not listed are 0):
 *
 *   kind              h.ctx           a                b                c                ptr
 *   EV_DECODE_BEGIN   llama_context*  batch n_tokens   first token id   first position   llama_batch*
 *                                     (-1, -1, -1 from decode(llama_batch_ext), which has no public layout)
 *   EV_UBATCH_END     llama_context*  -                -                -                process_ubatch's return value
 *   EV_SAMPLE_BEGIN   llama_context*  idx (row index)  sampler_kind     -                -
 *   EV_SAMPLE_END     llama_context*  sampled token    sampler_kind     idx              -
 *   EV_SEQ_RM         llama_memory*   seq id           p0               p1               -
 *   EV_MEM_CLEAR      llama_memory*   -                -                -                -
 *   EV_TASK_POST      -               first task id    1 single, 0 vec  -                vector bytes (0 single)
 *   EV_SLOT_LAUNCH    -               slot id          task id          -                server_slot*
 *   EV_SLOT_CHILD     -               child slot id    task id          parent slot id   child server_slot*
 *   EV_SLOT_RELEASE   -               slot id          -                -                server_slot*
 *   EV_SLOT_TOKEN     -               slot id          token id         -                server_slot*
 *   EV_HEAD_DRAW      llama_context*  seq id           1 kept, 0 not    row position     -
 */
struct ev_small {
    struct ev_hdr h;
    __s32 a;
    __s32 b;
    __s32 c;
    __s32 pad;
    __u64 ptr;
};

#define UB_FLAG_TRUNCATED 1
#define UB_FLAG_NO_TOKENS 2 /* the micro-batch carries embeddings, not token ids */

#define UBATCH_FIELDS(ROWS)                                                                     \
    struct ev_hdr h;                                                                            \
    __u32 n_tokens;             /* rows in the micro-batch */                                   \
    __u32 n_copied;             /* rows copied below (min(n_tokens, ROWS)) */                   \
    __u32 row_offset;           /* index of the first copied row: n_tokens - n_copied */        \
    __u32 pad;                  /* explicit: sizeof must equal the numpy mirror's itemsize */   \
    __s32 token[ROWS];                                                                          \
    __s32 pos[ROWS];                                                                            \
    __s32 seq[ROWS];            /* first seq id of each row */                                  \
    __s8 output[ROWS];          /* row produces logits */

/* The micro-batch record, in two sizes with the same fields: the ring reservation has a constant
 * size, and a one-row decode step in the 13 KiB record cost a 13 KiB copy out of the ring per
 * token. The consumer tells them apart by size (EV_UBATCH either way). */
struct ev_ubatch {
    UBATCH_FIELDS(MAX_UB_TOK)
};
struct ev_ubatch_s {
    UBATCH_FIELDS(UB_SMALL_TOK)
};

struct ev_logits {
    struct ev_hdr h;
    __s32 idx;                  /* argument of llama_get_logits_ith */
    __u32 chunk;                /* chunk number, 0-based */
    __u32 n_vals;               /* valid floats in vals */
    __u32 n_vocab;
    __u32 vals[LOGITS_CHUNK];   /* raw IEEE-754 bits (BPF has no floating point) */
};

/* ---- sparse decisions (sparse_common.bpf.c, sparse_{moe,activation,attention}.bpf.c) --------- */
#define NAME_LEN 32              /* tensor name bytes copied ("ffn_moe_weighted-47" fits) */
#define TENSOR_BYTES_S 1024      /* data of a small tensor record (a decode step) */
#define TENSOR_BYTES_L 16384     /* data of a large tensor record (prompt rows) */
#define MAX_TENSOR_CHUNKS 16     /* large records per tensor: rows beyond are counted as lost */
#define BLOCK_WORDS 64           /* 8-byte words (512 B) read and tested per block */
#define ACT_BLOCKS 32           /* blocks per thread per program run (4,096 floats): verifier budget */
#define ACT_MAX_ROWS 32          /* rows per activation record */
#define ATT_MAX_ROWS 8           /* output rows whose mask row is counted per micro-batch */
#define ATT_BLOCKS 16            /* blocks per mask (e.g. one row of 2,048 F32 cells): verifier budget */
#define ATT_ROW_SCAN 64          /* output flags scanned (from the end) to find output rows */

enum tensor_tag { TAG_EXPERT_IDS = 1, TAG_EXPERT_WEIGHTS = 2, TAG_ROUTER_PROBS = 3 };

#define ACT_FLAG_ODD_WIDTH 1     /* rows of odd width are not counted (pairs are read) */
#define ACT_FLAG_BUDGET 2        /* some of this thread's rows were beyond ACT_BLOCKS / ACT_MAX_ROWS */
#define ACT_FLAG_FAULT 4         /* a block could not be read: the rows from there on are uncounted */
#define ATT_FLAG_CACHED 1        /* same mask as an earlier layer of this micro-batch: no counts */
#define ATT_FLAG_BUDGET 2        /* output rows or row length beyond the counting budget */
#define ATT_FLAG_NO_UBATCH 4     /* not on a thread inside process_ubatch: rows unknown */
#define ATT_FLAG_F16 8           /* mask is F16 (flash attention); else F32 */
#define ATT_FLAG_UNCOUNTED 16    /* (aggregate only) no count for the row: n_counted was 0 */
#define ATT_FLAG_KV_MASK 32      /* counted where the engine writes the mask (kvmask_return), not at a layer */

struct ev_tensor_hdr {
    struct ev_hdr h;
    char name[NAME_LEN];
    __u16 tag;                  /* enum tensor_tag */
    __u16 type;                 /* ggml_type of the values (0 = F32, 26 = I32) */
    __u32 row0;                 /* first row in data */
    __u32 n_rows;               /* rows in data */
    __u32 rows_total;           /* rows of the tensor (micro-batch rows or its output rows) */
    __u32 ne0;                  /* values per row */
    __u32 row_stride;           /* bytes between rows in data */
    __u32 n_bytes;              /* valid bytes in data */
    __u32 pad;
};

struct ev_tensor_s {
    struct ev_tensor_hdr t;
    __u8 data[TENSOR_BYTES_S];
};

struct ev_tensor_l {
    struct ev_tensor_hdr t;
    __u8 data[TENSOR_BYTES_L];
};

struct ev_act {
    struct ev_hdr h;
    char name[NAME_LEN];
    __u32 ne0;                  /* values per row */
    __u32 ne1;                  /* k for MoE activations ([n_ff, k, n_tokens]); tokens for dense */
    __u32 ir0;                  /* first row of this thread */
    __u32 n_rows;               /* rows counted (from ir0) */
    __u32 nr_total;             /* rows of the whole node */
    __u32 ith;
    __u32 flags;
    __u32 pad;
    __u32 zeros[ACT_MAX_ROWS];  /* values == 0 per row */
    __u32 below[ACT_MAX_ROWS];  /* |value| < threshold per row */
};

struct ev_act_mask {
    struct ev_act a;
    __u64 bits[ACT_BLOCKS * 2];  /* 128 bits per block (row-major blocks, each row starts a block):
                                    bit set = value non-zero */
};

struct ev_attn {
    struct ev_hdr h;
    char name[NAME_LEN];
    __u64 mask;                 /* mask data pointer: layers sharing a mask share its counts */
    __u32 n_kv;                 /* mask row length (cells) */
    __u32 n_rows;               /* mask rows (micro-batch rows, padded) */
    __u32 n_counted;            /* rows counted below */
    __u32 flags;
    __u32 row[ATT_MAX_ROWS];    /* micro-batch row */
    __u32 attended[ATT_MAX_ROWS];  /* cells not masked (not -inf) in that row */
};

/* A one-row micro-batch (a decode step: the bulk of all steps) gathers its routing and
 * activation figures in one map value, filled by the graph-op probes on every thread (atomic
 * adds), and sends it as ONE record at the micro-batch's return, instead of ~4 records per
 * layer: the consumer's cost per record is what limits the profiler's overhead. */
#define AGG_MAX_LAYERS 128       /* the most layers an aggregate record can hold */
#ifndef AGG_LAYERS
/* The layers this session's aggregate records hold (a power of two, 8 to AGG_MAX_LAYERS): the
 * loader passes the model's need (events.agg_layers_for), so that a small model's record is a
 * few KiB smaller, which the probes clear, copy into the ring and the consumer copies out of it
 * once per token. Layers past it are sent as per-layer records, as for a record overflowed. */
#define AGG_LAYERS AGG_MAX_LAYERS
#endif
#ifndef AGG_LAYER_MASK
#define AGG_LAYER_MASK 127       /* AGG_LAYERS - 1, as a literal (idx_agg_layer()'s asm) */
#endif
#define AGG_MAX_K 8
#define AGG_TIMES_ONLY 3         /* ev_step_agg.active of a pass of several rows: only its layer
                                    times are gathered (the sparse probes send their records) */
#ifndef LT_THREADS
/* Engine threads (graph thread indices) whose layer times an aggregate record holds (a power of
 * two: the loader passes events.lt_threads_for, sized to the host's CPUs); a probe point on a
 * thread index past them is counted in lt_lost, not timed. */
#define LT_THREADS 16
#endif
#ifndef LT_THREAD_MASK
#define LT_THREAD_MASK 15        /* LT_THREADS - 1, as a literal (idx_lt_thread()'s asm) */
#endif

struct ev_step_agg {
    struct ev_hdr h;
    __u64 serial;                          /* sequence number of the micro-batch's EV_UBATCH */
    __u32 active;                          /* 1 (2: activations not counted), AGG_TIMES_ONLY */
    __u32 overlap;                         /* another micro-batch ran meanwhile: not attributable */
    __u32 k_ids[AGG_LAYERS];           /* expert ids present for the layer (0: not seen) */
    __u32 k_wts[AGG_LAYERS];
    __s32 ids[AGG_LAYERS][AGG_MAX_K];
    __u32 wts[AGG_LAYERS][AGG_MAX_K];  /* float bits */
    __u32 act_zero[AGG_LAYERS];        /* summed over the node's rows (expert slots) */
    __u32 act_below[AGG_LAYERS];
    __u32 act_rows[AGG_LAYERS];        /* rows counted, all threads */
    __u32 act_nr[AGG_LAYERS];          /* rows of the node */
    __u32 act_ne0[AGG_LAYERS];         /* values per row */
    __u32 act_slots[AGG_LAYERS];       /* rows per token: k for MoE activations, else 1 */
    /* attention nodes of the pass, in the order they ran (what an EV_ATTN record would carry for
     * the one output row): 8 records per token fewer in full mode */
    __u32 att_n;                           /* nodes stored below */
    __u32 att_pad;
    __u64 att_mask[AGG_LAYERS];        /* mask data pointer (layers sharing it share the count) */
    __s32 att_layer[AGG_LAYERS];       /* layer from the node's name, -1 if unnamed */
    __u32 att_count[AGG_LAYERS];       /* cells attended by the row (when counted) */
    __u32 att_flags[AGG_LAYERS];       /* ATT_FLAG_*, plus ATT_FLAG_UNCOUNTED */
    /* layer times (correlate/layer_times.py): when each engine thread first reached each layer's
     * probe point (agg_layer_time in sparse_common.bpf.c), no probe of its own: the sparse
     * probes' hits, timed */
    __u64 t0_ns;                           /* the step's start: its EV_UBATCH record's ts_ns */
    __u32 lt_lost;                         /* probe points not timed: a thread index past
                                              LT_THREADS, a layer past AGG_LAYERS, or 2^32 ns or
                                              more after t0 */
    __u32 lt_pad;
    __u32 lt_tid[LT_THREADS];              /* OS thread id of each graph thread index (0: none) */
    __u32 lt_off[LT_THREADS][AGG_LAYERS];  /* ns after t0_ns when thread index t first reached
                                              layer L's probe point; 0: it did not */
};

/* ---- serving context ------------------------------------------------------------------- */
#define HTTP_BYTES 4096          /* bytes of one socket read copied (request line and headers);
                                    cpp-httplib reads at most 4 KiB at a time */
#define MAX_CHILD_SLOTS 8        /* child slots reported per parent task (n > 1) */

struct ev_http {
    struct ev_hdr h;
    __s32 fd;
    __u32 len;                  /* bytes the read returned */
    __u32 n_copied;             /* bytes in data: min(len, HTTP_BYTES) */
    __u32 pad;
    __u64 buf;                  /* user buffer address (also keeps the size apart from a logits record's) */
    __u8 data[HTTP_BYTES];
};

#endif
