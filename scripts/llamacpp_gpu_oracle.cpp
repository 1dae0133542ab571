// The GPU routing oracle for scripts/gpu_check.sh's llama.cpp section: the same llama.cpp build
// as the server under test (compiled and linked against its libllama by
// scripts/build_llamacpp_cuda.sh), in a process of its own, teacher-forced with the tokens the
// recording holds. One llama_decode of every token with logits for every row; an eval callback
// (cb_eval) asks for the tensors `ffn_moe_topk-L` (the top-k expert ids of layer L, a view of the
// argsort with row stride nb[1]) and copies them back from whichever device computed them.
//
//   llamacpp-gpu-oracle MODEL.gguf N_GPU_LAYERS TOKENS_FILE > trace.jsonl
//
// TOKENS_FILE: token ids separated by white space. Output, JSON lines:
//   {"kind":"meta","n_tokens":N,"n_vocab":V,"n_gpu_layers":G}
//   {"kind":"moe","layer":L,"positions":[...],"ids":[[k ids] per row]}   per layer and micro-batch
//   {"kind":"logprob","pos":i,"next":t,"logprob":lp,"argmax":a}   log p(tokens[i+1] | tokens[..i])
//   {"kind":"error","error":"..."}
// Exit 0 when every step worked, 1 otherwise (the error line says why).
//
// Asking for a tensor splits the graph there, so ggml-cuda cannot fuse the routing into its
// topk_moe kernel: the oracle's ids come from the unfused argsort path of the same build.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "ggml-backend.h"
#include "ggml.h"
#include "llama.h"

namespace {

struct Trace {
    int next_pos[1024] = {};  // per layer: the position of the next row seen (micro-batches in order)
    bool failed = false;
};

const char kTopk[] = "ffn_moe_topk-";

void error_line(const std::string & what) {
    std::string s;
    for (char c : what) s += (c == '"' || c == '\\') ? ' ' : c;
    std::printf("{\"kind\":\"error\",\"error\":\"%s\"}\n", s.c_str());
}

bool on_tensor(struct ggml_tensor * t, bool ask, void * user_data) {
    auto * tr = static_cast<Trace *>(user_data);
    const bool wanted = std::strncmp(t->name, kTopk, sizeof kTopk - 1) == 0;
    if (ask) return wanted;
    if (!wanted) return true;
    const int layer = std::atoi(t->name + sizeof kTopk - 1);
    if (t->type != GGML_TYPE_I32 || layer < 0 || layer >= 1024) {
        error_line(std::string("unexpected tensor ") + t->name);
        tr->failed = true;
        return true;
    }
    const int64_t k = t->ne[0], rows = t->ne[1];
    std::vector<char> raw(ggml_nbytes(t));
    ggml_backend_tensor_get(t, raw.data(), 0, raw.size());  // a view: nbytes spans the strided rows
    std::printf("{\"kind\":\"moe\",\"layer\":%d,\"positions\":[", layer);
    for (int64_t r = 0; r < rows; r++) std::printf("%s%d", r ? "," : "", tr->next_pos[layer] + (int)r);
    std::printf("],\"ids\":[");
    for (int64_t r = 0; r < rows; r++) {
        std::printf("%s[", r ? "," : "");
        for (int64_t j = 0; j < k; j++) {
            int32_t id;
            std::memcpy(&id, raw.data() + r * t->nb[1] + j * t->nb[0], sizeof id);
            std::printf("%s%d", j ? "," : "", id);
        }
        std::printf("]");
    }
    std::printf("]}\n");
    tr->next_pos[layer] += (int)rows;
    return true;
}

}  // namespace

int main(int argc, char ** argv) {
    if (argc != 4) {
        std::fprintf(stderr, "usage: %s MODEL.gguf N_GPU_LAYERS TOKENS_FILE\n", argv[0]);
        return 2;
    }
    std::vector<llama_token> tokens;
    {
        std::ifstream in(argv[3]);
        long v;
        while (in >> v) tokens.push_back((llama_token)v);
    }
    if (tokens.size() < 2) {
        error_line("fewer than 2 tokens to force");
        return 1;
    }
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = std::atoi(argv[2]);
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (model == nullptr) {
        error_line("cannot load the model");
        return 1;
    }
    Trace trace;
    llama_context_params cp = llama_context_default_params();
    const uint32_t n = (uint32_t)tokens.size();
    cp.n_ctx = n < 512 ? 512 : n;
    cp.n_batch = cp.n_ctx;
    cp.n_ubatch = cp.n_ctx;  // one micro-batch: every layer's rows in one tensor
    cp.cb_eval = on_tensor;
    cp.cb_eval_user_data = &trace;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (ctx == nullptr) {
        error_line("cannot create the context");
        return 1;
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    std::printf("{\"kind\":\"meta\",\"n_tokens\":%u,\"n_vocab\":%d,\"n_gpu_layers\":%d}\n", n, n_vocab, mp.n_gpu_layers);
    llama_batch batch = llama_batch_init((int32_t)n, 0, 1);
    for (uint32_t i = 0; i < n; i++) {
        batch.token[i] = tokens[i];
        batch.pos[i] = (llama_pos)i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;
    }
    batch.n_tokens = (int32_t)n;
    int rc = llama_decode(ctx, batch);
    if (rc != 0) {
        error_line("llama_decode returned " + std::to_string(rc));
        trace.failed = true;
    } else {
        for (uint32_t i = 0; i + 1 < n; i++) {
            const float * lg = llama_get_logits_ith(ctx, (int32_t)i);
            double mx = -INFINITY;
            int arg = 0;
            for (int v = 0; v < n_vocab; v++)
                if (lg[v] > mx) mx = lg[v], arg = v;
            double sum = 0;
            for (int v = 0; v < n_vocab; v++) sum += std::exp((double)lg[v] - mx);
            const double lp = (double)lg[tokens[i + 1]] - mx - std::log(sum);
            std::printf("{\"kind\":\"logprob\",\"pos\":%u,\"next\":%d,\"logprob\":%.9g,\"argmax\":%d}\n", i,
                        tokens[i + 1], lp, arg);
        }
    }
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    std::fflush(stdout);
    return trace.failed ? 1 : 0;
}
