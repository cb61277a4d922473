// ptxgen-logits: run llama.cpp on a token sequence and write its logits.
//
// usage: ptxgen-logits MODEL.gguf OUT.f32 --tokens 1,2,3 [options]
//
//   --tokens LIST     comma-separated token ids (required)
//   --all             write the logits of every position (default: the last)
//   --stepwise        one llama_decode per token (as a decode loop runs);
//                     default: one batch with the whole sequence
//   --threads N       CPU threads (default 1: a fixed summation order)
//   --kv f16|f32      KV cache type (default f16, llama.cpp's default)
//   --flash-attn on|off|auto   (default off)
//   --override KEY=TYPE:VALUE  override (or supply) a metadata key; TYPE is
//                     int, float, bool or str (e.g. tokenizer.ggml.model=str:none
//                     for a file without a tokenizer); repeatable
//   --verbose         keep llama.cpp's log on stderr
//
// OUT is raw little-endian float32, rows x n_vocab, row r the logits after
// position r (or the single last row). A line "rows=R n_vocab=V" goes to
// stdout on success. Exit status 2 for bad arguments, 1 for llama.cpp errors.

#include "llama.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

bool g_verbose = false;

void quiet_log(enum ggml_log_level level, const char * text, void *) {
    if (g_verbose || level == GGML_LOG_LEVEL_ERROR) {
        std::fputs(text, stderr);
    }
}

int usage(const char * msg) {
    std::fprintf(stderr, "ptxgen-logits: %s\n"
                 "usage: ptxgen-logits MODEL.gguf OUT.f32 --tokens 1,2,3 [--all] [--stepwise]\n"
                 "       [--threads N] [--kv f16|f32] [--flash-attn on|off|auto]\n"
                 "       [--override KEY=TYPE:VALUE]... [--verbose]\n", msg);
    return 2;
}

bool parse_tokens(const char * s, std::vector<llama_token> & out) {
    std::string cur;
    for (const char * p = s;; ++p) {
        if (*p == ',' || *p == '\0') {
            if (cur.empty()) return false;
            char * end = nullptr;
            long v = std::strtol(cur.c_str(), &end, 10);
            if (*end != '\0' || v < 0 || v > INT32_MAX) return false;
            out.push_back(static_cast<llama_token>(v));
            cur.clear();
            if (*p == '\0') break;
        } else {
            cur.push_back(*p);
        }
    }
    return !out.empty();
}

// KEY=TYPE:VALUE -> one llama_model_kv_override; false on a malformed item.
bool parse_override(const std::string & item, llama_model_kv_override & o) {
    const size_t eq = item.find('=');
    const size_t colon = item.find(':', eq == std::string::npos ? 0 : eq);
    if (eq == std::string::npos || colon == std::string::npos || eq == 0 ||
        eq >= sizeof(o.key)) {
        return false;
    }
    std::memset(&o, 0, sizeof(o));
    std::memcpy(o.key, item.data(), eq);
    const std::string type = item.substr(eq + 1, colon - eq - 1);
    const std::string value = item.substr(colon + 1);
    char * end = nullptr;
    if (type == "int") {
        o.tag = LLAMA_KV_OVERRIDE_TYPE_INT;
        o.val_i64 = std::strtoll(value.c_str(), &end, 10);
        return !value.empty() && *end == '\0';
    }
    if (type == "float") {
        o.tag = LLAMA_KV_OVERRIDE_TYPE_FLOAT;
        o.val_f64 = std::strtod(value.c_str(), &end);
        return !value.empty() && *end == '\0';
    }
    if (type == "bool") {
        o.tag = LLAMA_KV_OVERRIDE_TYPE_BOOL;
        if (value != "true" && value != "false") return false;
        o.val_bool = value == "true";
        return true;
    }
    if (type == "str") {
        o.tag = LLAMA_KV_OVERRIDE_TYPE_STR;
        if (value.size() >= sizeof(o.val_str)) return false;
        std::memcpy(o.val_str, value.data(), value.size());
        return true;
    }
    return false;
}

}  // namespace

int main(int argc, char ** argv) {
    if (argc < 3) return usage("need MODEL and OUT");
    const char * model_path = argv[1];
    const char * out_path = argv[2];
    std::vector<llama_token> tokens;
    bool all = false, stepwise = false;
    int threads = 1;
    ggml_type kv_type = GGML_TYPE_F16;
    llama_flash_attn_type fa = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    std::vector<llama_model_kv_override> overrides;

    for (int i = 3; i < argc; ++i) {
        std::string a = argv[i];
        auto value = [&](const char * name) -> const char * {
            if (i + 1 >= argc) { usage((std::string(name) + " needs a value").c_str()); std::exit(2); }
            return argv[++i];
        };
        if (a == "--tokens") {
            const char * v = value("--tokens");
            if (!parse_tokens(v, tokens)) return usage("--tokens: expected comma-separated non-negative integers");
        } else if (a == "--all") {
            all = true;
        } else if (a == "--stepwise") {
            stepwise = true;
        } else if (a == "--threads") {
            threads = std::atoi(value("--threads"));
            if (threads < 1) return usage("--threads must be >= 1");
        } else if (a == "--kv") {
            std::string v = value("--kv");
            if (v == "f16") kv_type = GGML_TYPE_F16;
            else if (v == "f32") kv_type = GGML_TYPE_F32;
            else return usage("--kv must be f16 or f32");
        } else if (a == "--flash-attn") {
            std::string v = value("--flash-attn");
            if (v == "on") fa = LLAMA_FLASH_ATTN_TYPE_ENABLED;
            else if (v == "off") fa = LLAMA_FLASH_ATTN_TYPE_DISABLED;
            else if (v == "auto") fa = LLAMA_FLASH_ATTN_TYPE_AUTO;
            else return usage("--flash-attn must be on, off or auto");
        } else if (a == "--override") {
            llama_model_kv_override o;
            if (!parse_override(value("--override"), o)) {
                return usage("--override: expected KEY=TYPE:VALUE with TYPE int, float, bool or str");
            }
            overrides.push_back(o);
        } else if (a == "--verbose") {
            g_verbose = true;
        } else {
            return usage(("unknown argument " + a).c_str());
        }
    }
    if (tokens.empty()) return usage("--tokens is required");

    llama_log_set(quiet_log, nullptr);
    llama_backend_init();

    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    if (!overrides.empty()) {
        overrides.emplace_back();
        std::memset(&overrides.back(), 0, sizeof(overrides.back()));   // the terminator: empty key
        mp.kv_overrides = overrides.data();
    }
    llama_model * model = llama_model_load_from_file(model_path, mp);
    if (model == nullptr) {
        std::fprintf(stderr, "ptxgen-logits: cannot load %s\n", model_path);
        return 1;
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    for (llama_token t : tokens) {
        if (t >= n_vocab) {
            std::fprintf(stderr, "ptxgen-logits: token %d out of range (vocabulary %d)\n", t, n_vocab);
            return 2;
        }
    }

    const int n = static_cast<int>(tokens.size());
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = static_cast<uint32_t>(n < 256 ? 256 : n);
    cp.n_batch = static_cast<uint32_t>(n);
    cp.n_ubatch = static_cast<uint32_t>(n);
    cp.n_seq_max = 1;
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    cp.type_k = kv_type;
    cp.type_v = kv_type;
    cp.flash_attn_type = fa;
    cp.no_perf = true;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (ctx == nullptr) {
        std::fprintf(stderr, "ptxgen-logits: cannot create a context\n");
        return 1;
    }

    std::vector<float> out;
    const int rows = all ? n : 1;
    out.reserve(static_cast<size_t>(rows) * n_vocab);
    auto take = [&](int idx) -> bool {
        const float * lg = llama_get_logits_ith(ctx, idx);
        if (lg == nullptr) return false;
        out.insert(out.end(), lg, lg + n_vocab);
        return true;
    };

    const int chunk = stepwise ? 1 : n;
    llama_batch batch = llama_batch_init(chunk, 0, 1);
    for (int start = 0; start < n; start += chunk) {
        const int m = (n - start < chunk) ? n - start : chunk;
        batch.n_tokens = m;
        for (int j = 0; j < m; ++j) {
            const int p = start + j;
            batch.token[j] = tokens[p];
            batch.pos[j] = p;
            batch.n_seq_id[j] = 1;
            batch.seq_id[j][0] = 0;
            batch.logits[j] = (all || p == n - 1) ? 1 : 0;
        }
        const int rc = llama_decode(ctx, batch);
        if (rc != 0) {
            std::fprintf(stderr, "ptxgen-logits: llama_decode returned %d at position %d\n", rc, start);
            return 1;
        }
        for (int j = 0; j < m; ++j) {
            if (batch.logits[j] && !take(j)) {
                std::fprintf(stderr, "ptxgen-logits: no logits for position %d\n", start + j);
                return 1;
            }
        }
    }
    llama_batch_free(batch);

    FILE * f = std::fopen(out_path, "wb");
    if (f == nullptr) {
        std::fprintf(stderr, "ptxgen-logits: cannot write %s\n", out_path);
        return 1;
    }
    const size_t wrote = std::fwrite(out.data(), sizeof(float), out.size(), f);
    if (std::fclose(f) != 0 || wrote != out.size()) {
        std::fprintf(stderr, "ptxgen-logits: short write to %s\n", out_path);
        return 1;
    }
    std::printf("rows=%d n_vocab=%d\n", rows, n_vocab);

    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
