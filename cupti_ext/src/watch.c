/* Watched kernels: `pattern:arg:dtype:rule` entries, separated by ';' or newlines, '#' starts a
 * comment. The rule gives the buffer's shape: dimensions separated by ',', each a product ('*')
 * of constants, `argN` (int32 scalar argument N), `argN.i64` (int64 scalar argument N) and
 * grid.x|y|z / block.x|y|z. Example: topk_hist_kernel:0:int32:arg2,arg3 */
#define _GNU_SOURCE
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static const struct {
    const char *name;
    uint32_t code, size;
} DTYPES[] = {
    {"int8", DT_INT8, 1},       {"uint8", DT_UINT8, 1},       {"int16", DT_INT16, 2},
    {"uint16", DT_UINT16, 2},   {"int32", DT_INT32, 4},       {"uint32", DT_UINT32, 4},
    {"int64", DT_INT64, 8},     {"uint64", DT_UINT64, 8},     {"float16", DT_FLOAT16, 2},
    {"bfloat16", DT_BFLOAT16, 2}, {"float32", DT_FLOAT32, 4}, {"float64", DT_FLOAT64, 8},
    {"bool", DT_BOOL, 1},
};

static char *trim(char *s) {
    while (isspace((unsigned char)*s)) s++;
    char *e = s + strlen(s);
    while (e > s && isspace((unsigned char)e[-1])) *--e = '\0';
    return s;
}

static int parse_uint(const char *s, uint64_t *out) {
    if (!isdigit((unsigned char)*s)) return -1;
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    if (*end != '\0') return -1;
    *out = v;
    return 0;
}

static int parse_term(char *t, struct watch_term *term) {
    t = trim(t);
    static const char *geo[] = {"grid.x", "grid.y", "grid.z", "block.x", "block.y", "block.z"};
    for (unsigned i = 0; i < 6; i++)
        if (strcmp(t, geo[i]) == 0) {
            term->kind = (enum term_kind)(T_GRID_X + i);
            term->value = 0;
            return 0;
        }
    if (strncmp(t, "arg", 3) == 0) {
        char *dot = strchr(t, '.');
        term->kind = T_ARG32;
        if (dot != NULL) {
            if (strcmp(dot, ".i64") != 0) return -1;
            *dot = '\0';
            term->kind = T_ARG64;
        }
        return parse_uint(t + 3, &term->value);
    }
    term->kind = T_CONST;
    return parse_uint(t, &term->value);
}

static int parse_entry(char *line, struct watch *w, char *err, size_t errlen) {
    /* Split from the right: the pattern may itself contain ':' (a demangled name). */
    char *c3 = strrchr(line, ':');
    if (c3 == NULL) goto bad;
    *c3 = '\0';
    char *c2 = strrchr(line, ':');
    if (c2 == NULL) goto bad;
    *c2 = '\0';
    char *c1 = strrchr(line, ':');
    if (c1 == NULL) goto bad;
    *c1 = '\0';
    char *pattern = trim(line), *arg = trim(c1 + 1), *dtype = trim(c2 + 1), *rule = trim(c3 + 1);
    memset(w, 0, sizeof *w);
    if (pattern[0] == '\0' || strlen(pattern) >= sizeof w->pattern) {
        snprintf(err, errlen, "watch pattern empty or longer than %zu bytes", sizeof w->pattern - 1);
        return -1;
    }
    strcpy(w->pattern, pattern);
    uint64_t a;
    if (parse_uint(arg, &a) != 0 || a > 255) {
        snprintf(err, errlen, "watch '%s': argument index '%s' is not a number below 256", pattern, arg);
        return -1;
    }
    w->arg_index = (unsigned)a;
    for (size_t i = 0; i < sizeof DTYPES / sizeof DTYPES[0]; i++)
        if (strcmp(dtype, DTYPES[i].name) == 0) {
            w->dtype = DTYPES[i].code;
            w->elem_size = DTYPES[i].size;
        }
    if (w->dtype == 0) {
        snprintf(err, errlen, "watch '%s': unknown dtype '%s'", pattern, dtype);
        return -1;
    }
    char *save_d = NULL;
    for (char *dim = strtok_r(rule, ",", &save_d); dim != NULL; dim = strtok_r(NULL, ",", &save_d)) {
        if (w->ndim == WATCH_MAX_DIMS) {
            snprintf(err, errlen, "watch '%s': more than %d dimensions", pattern, WATCH_MAX_DIMS);
            return -1;
        }
        struct watch_dim *d = &w->dims[w->ndim++];
        char *save_t = NULL;
        for (char *t = strtok_r(dim, "*", &save_t); t != NULL; t = strtok_r(NULL, "*", &save_t)) {
            if (d->nterms == WATCH_MAX_TERMS || parse_term(t, &d->terms[d->nterms]) != 0) {
                snprintf(err, errlen, "watch '%s': bad count term '%s' (constant, argN, argN.i64, grid.x|y|z, "
                         "block.x|y|z; at most %d per dimension)", pattern, trim(t), WATCH_MAX_TERMS);
                return -1;
            }
            d->nterms++;
        }
        if (d->nterms == 0) goto bad;
    }
    if (w->ndim == 0) goto bad;
    return 0;
bad:
    snprintf(err, errlen, "watch entry is not pattern:arg:dtype:rule");
    return -1;
}

HIDDEN int watch_parse(const char *text, struct watch *out, int max, int *n, char *err, size_t errlen) {
    char *copy = strdup(text);
    if (copy == NULL) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    int rc = 0;
    char *save = NULL;
    for (char *line = strtok_r(copy, ";\n", &save); line != NULL; line = strtok_r(NULL, ";\n", &save)) {
        char *hash = strchr(line, '#');
        if (hash != NULL) *hash = '\0';
        line = trim(line);
        if (line[0] == '\0') continue;
        if (*n == max) {
            snprintf(err, errlen, "more than %d watched kernels", max);
            rc = -1;
            break;
        }
        if (parse_entry(line, &out[*n], err, errlen) != 0) {
            rc = -1;
            break;
        }
        (*n)++;
    }
    free(copy);
    return rc;
}

HIDDEN struct watch *watch_match(struct watch *ws, int n, const char *kernel_name) {
    if (kernel_name == NULL) return NULL;
    for (int i = 0; i < n; i++)
        if (strstr(kernel_name, ws[i].pattern) != NULL) return &ws[i];
    return NULL;
}

/* Where argument i lives and how big it is: checked against the function's real parameter list
 * when the driver can tell (cuFuncGetParamInfo), so a wrong index fails instead of reading
 * garbage through kernelParams. A handle it refuses as invalid (a CUkernel, which
 * cuLaunchKernel accepts too) is refused with CUDA_ERROR_INVALID_HANDLE: the driver cannot tell, so the rule
 * is trusted as for runtime launches. */
static int arg_ptr(const struct launch_geom *g, uint64_t idx, size_t want, const void **p, char *err,
                   size_t errlen) {
    if (g->params == NULL) {
        snprintf(err, errlen, "launch passes its arguments through `extra`, not kernelParams");
        return -1;
    }
    if (g->func != NULL && cu.FuncGetParamInfo != NULL) {
        size_t off = 0, size = 0;
        CUresult r = cu.FuncGetParamInfo(g->func, (size_t)idx, &off, &size);
        if (r == CUDA_ERROR_INVALID_HANDLE) {
            /* not a CUfunction: nothing to check against */
        } else if (r != CUDA_SUCCESS) {
            snprintf(err, errlen, "argument %llu does not exist (cuFuncGetParamInfo: %s)", (unsigned long long)idx,
                     cu_error_name(r));
            return -1;
        } else if (size != want) {
            snprintf(err, errlen, "argument %llu is %zu bytes, the rule reads %zu", (unsigned long long)idx, size,
                     want);
            return -1;
        }
    }
    *p = g->params[idx];
    if (*p == NULL) {
        snprintf(err, errlen, "argument %llu has no value", (unsigned long long)idx);
        return -1;
    }
    return 0;
}

HIDDEN int watch_eval(const struct watch *w, const struct launch_geom *g, uint64_t shape[WATCH_MAX_DIMS],
                      uint64_t *bytes, CUdeviceptr *src, char *err, size_t errlen) {
    const void *p;
    if (arg_ptr(g, w->arg_index, sizeof(CUdeviceptr), &p, err, errlen) != 0) return -1;
    memcpy(src, p, sizeof *src);
    uint64_t total = 1;
    for (int d = 0; d < WATCH_MAX_DIMS; d++) shape[d] = 0;
    for (int d = 0; d < w->ndim; d++) {
        uint64_t v = 1;
        for (int t = 0; t < w->dims[d].nterms; t++) {
            const struct watch_term *term = &w->dims[d].terms[t];
            uint64_t x = 0;
            switch (term->kind) {
            case T_CONST: x = term->value; break;
            case T_ARG32: {
                int32_t i32;
                if (arg_ptr(g, term->value, 4, &p, err, errlen) != 0) return -1;
                memcpy(&i32, p, 4);
                if (i32 < 0) {
                    snprintf(err, errlen, "argument %llu is negative (%d)", (unsigned long long)term->value, i32);
                    return -1;
                }
                x = (uint64_t)i32;
                break;
            }
            case T_ARG64: {
                int64_t i64;
                if (arg_ptr(g, term->value, 8, &p, err, errlen) != 0) return -1;
                memcpy(&i64, p, 8);
                if (i64 < 0) {
                    snprintf(err, errlen, "argument %llu is negative", (unsigned long long)term->value);
                    return -1;
                }
                x = (uint64_t)i64;
                break;
            }
            case T_GRID_X: case T_GRID_Y: case T_GRID_Z: x = g->grid[term->kind - T_GRID_X]; break;
            case T_BLOCK_X: case T_BLOCK_Y: case T_BLOCK_Z: x = g->block[term->kind - T_BLOCK_X]; break;
            }
            if (x != 0 && v > UINT64_MAX / x) {
                snprintf(err, errlen, "element count overflows");
                return -1;
            }
            v *= x;
        }
        shape[d] = v;
        if (v != 0 && total > UINT64_MAX / v) {
            snprintf(err, errlen, "element count overflows");
            return -1;
        }
        total *= v;
    }
    if (total > UINT64_MAX / w->elem_size) {
        snprintf(err, errlen, "element count overflows");
        return -1;
    }
    *bytes = total * w->elem_size;
    return 0;
}
