package sk.ainet.transformers.iree.android

import java.io.File
import java.nio.file.Files
import java.util.Properties
import java.util.concurrent.CountDownLatch
import java.util.concurrent.TimeUnit
import kotlin.system.exitProcess

/**
 * The app-level API (`Engine`, `Conversation`) on the JVM over the host library, on the fixture
 * export `jni-fixture` wrote (`engine.*` keys): the quickstart of docs/android.md as written,
 * streaming, cancellation mid-decode, two conversations on one model, a catalog file loaded by a
 * new process, and misuse. Run: `java -Djava.library.path=target/debug -cp ... JniEngineTestKt
 * fixture.properties` (scripts/test-jni.sh).
 */
private class EngineFixture(path: String) {
    // UTF-8: the expected arguments hold what random weights wrote.
    private val p = Properties().apply { File(path).reader(Charsets.UTF_8).use { load(it) } }
    operator fun get(key: String): String = p.getProperty(key) ?: error("fixture has no `$key`")
    val dir = this["engine.dir"]
    val toolsJson = File(this["engine.tools"]).readText()
    val requests = (0 until this["engine.requests"].toInt()).map { this["engine.request.$it"] }
    /** The calls the Rust API answered request `i` with, as `name argumentsJson | ...`. */
    fun expected(i: Int) = this["engine.expected.$i"]
}

private fun calls(reply: Reply) = reply.toolCalls.joinToString(" | ") { "${it.name} ${it.argumentsJson}" }

private var checks = 0
private val failures = ArrayList<String>()

private fun check(name: String, ok: Boolean, detail: () -> String = { "" }) {
    checks++
    if (!ok) failures.add("$name ${detail()}")
}

/** Runs [block], which must throw [EngineException] of [kind] whose message contains [needle]. */
private fun throwsKind(name: String, kind: String, needle: String = "", block: () -> Unit) {
    try {
        block()
        check(name, false) { "did not throw" }
    } catch (e: EngineException) {
        check(name, e.kind == kind && e.message!!.contains(needle)) { "threw [${e.kind}] ${e.message}" }
    } catch (e: Throwable) {
        check(name, false) { "threw $e, not EngineException" }
    }
}

// quickstart:begin
fun quickstart(exportDir: String, toolsJson: String, filesDir: File): List<Reply> =
    Engine.open(exportDir).use { engine ->
        val config = ConversationConfig(
            systemPrompt = "You control a smart home.",
            toolsJson = toolsJson,
            toolChoice = "required",
            catalogFile = File(filesDir, "catalog.skvsnap").path,
        )
        // A conversation per request: each starts from the catalog (prefilled for the first,
        // kept by the engine for the others, loaded from catalogFile at the next app start).
        listOf("Turn on the kitchen lights.", "Set a timer for ten minutes.", "Dim the bedroom to 30 percent.").map { request ->
            engine.createConversation(config).use { conversation ->
                conversation.send(request) { piece -> print(piece) }.also { reply ->
                    println()
                    for (call in reply.toolCalls) println("${call.name} ${call.argumentsJson}")
                }
            }
        }
    }
// quickstart:end

private fun config(f: EngineFixture, catalogFile: String? = null) = ConversationConfig(
    systemPrompt = "You control a smart home.",
    toolsJson = f.toolsJson,
    toolChoice = "required",
    catalogFile = catalogFile,
)

fun main(args: Array<String>) {
    if (args.size == 3 && args[0] == "--load-catalog") {
        exitProcess(loadCatalogInNewProcess(EngineFixture(args[1]), args[2]))
    }
    if (args.size == 3 && args[0] == "--real") {
        exitProcess(realModel(args[1], File(args[2]).readText()))
    }
    val f = EngineFixture(args.getOrNull(0) ?: error("usage: JniEngineTest fixture.properties"))
    val filesDir = Files.createTempDirectory("skainet-engine-test").toFile()
    try {
        scenario(f, filesDir)
        newProcess(f, args[0], File(filesDir, "catalog.skvsnap"))
        Engine.open(f.dir).use { engine ->
            streaming(f, engine)
            cancellation(f, engine)
            twoConversations(f, engine)
            misuse(f, engine, filesDir)
            deviceProfile(f, engine, filesDir)
        }
        closed(f)
    } finally {
        filesDir.deleteRecursively()
    }
    if (failures.isNotEmpty()) {
        System.err.println("JniEngineTest: ${failures.size} of $checks checks failed:")
        failures.forEach { System.err.println("  $it") }
        exitProcess(1)
    }
    println("JniEngineTest: all $checks checks passed")
}

/** The quickstart as docs/android.md shows it: three requests, three parsed calls, the Rust API's. */
private fun scenario(f: EngineFixture, filesDir: File) {
    check("quickstart requests are the fixture's", f.requests == listOf("Turn on the kitchen lights.", "Set a timer for ten minutes.", "Dim the bedroom to 30 percent."))
    val replies = quickstart(f.dir, f.toolsJson, filesDir)
    replies.forEachIndexed { i, reply ->
        check("quickstart reply $i has one tool call", reply.toolCalls.size == 1 && reply.invalidToolCalls.isEmpty()) { "$reply" }
        check("quickstart reply $i equals the Rust API's", calls(reply) == f.expected(i)) { "got ${calls(reply)}, want ${f.expected(i)}" }
        check("quickstart reply $i ended at a stop", reply.finish == Finish.STOP) { "${reply.finish}" }
    }
    check("quickstart saved the catalog", File(filesDir, "catalog.skvsnap").isFile)
    Engine.open(f.dir).use { engine ->
        check("engine reads the export's vocabulary", engine.vocabSize > 0 && engine.toolFormat == "functiongemma") { "${engine.toolFormat}" }
        check("engine reads the stop ids", engine.stopIds.isNotEmpty())
    }
}

/**
 * The quickstart as written on a real model's export (scripts/test-long.sh engine): each request
 * answered with the call its words ask for (the tool's name; arguments are the model's).
 */
private fun realModel(exportDir: String, toolsJson: String): Int {
    val filesDir = Files.createTempDirectory("skainet-engine-real").toFile()
    try {
        val replies = quickstart(exportDir, toolsJson, filesDir)
        val want = listOf("set_lights", "set_timer", "set_lights")
        val got = replies.map { r -> r.toolCalls.map { it.name } }
        println("JniEngineTest --real: calls $got (the requests ask for $want), ${replies.map { "%.0f ms".format(it.elapsedMs) }}")
        // Fails on an answer without exactly one valid call; a valid call of another tool is the
        // model's choice (printed above), not the runtime's error.
        return if (replies.all { it.toolCalls.size == 1 && it.invalidToolCalls.isEmpty() }) 0 else 1
    } finally {
        filesDir.deleteRecursively()
    }
}

/** A new JVM loads the catalog file the quickstart wrote instead of prefilling. */
private fun newProcess(f: EngineFixture, properties: String, catalog: File) {
    val java = File(System.getProperty("java.home"), "bin/java").path
    val command = listOf(
        java, "-Xcheck:jni", "-Djava.library.path=${System.getProperty("java.library.path")}",
        "-cp", System.getProperty("java.class.path"), "sk.ainet.transformers.iree.android.JniEngineTestKt",
        "--load-catalog", properties, catalog.path,
    )
    val process = ProcessBuilder(command).redirectErrorStream(true).start()
    val output = process.inputStream.bufferedReader().readText()
    val finished = process.waitFor(120, TimeUnit.SECONDS)
    check("a new process answers from the saved catalog", finished && process.exitValue() == 0) { output }
}

private fun loadCatalogInNewProcess(f: EngineFixture, catalog: String): Int =
    Engine.open(f.dir).use { engine ->
        engine.createConversation(config(f, catalog)).use { conversation ->
            val reply = conversation.send(f.requests[0])
            when {
                conversation.catalogSource != CatalogSource.FILE -> 1.also { System.err.println("catalog ${conversation.catalogSource}") }
                calls(reply) != f.expected(0) -> 2.also { System.err.println("got ${calls(reply)}") }
                else -> 0
            }
        }
    }

private fun streaming(f: EngineFixture, engine: Engine) {
    engine.createConversation(config(f)).use { conversation ->
        val pieces = ArrayList<String>()
        val reply = conversation.send(f.requests[0]) { pieces.add(it) }
        val streamed = pieces.joinToString("")
        check("streaming: several pieces", pieces.size > 1) { "$pieces" }
        check("streaming: the text holds the call", streamed.contains(reply.toolCalls.firstOrNull()?.name ?: "?")) { streamed }
        check("streaming: same reply as the Rust API", calls(reply) == f.expected(0)) { calls(reply) }
    }
    engine.createConversation(config(f)).use { conversation ->
        // A listener that throws stops the answer; its own exception reaches the caller.
        try {
            conversation.send(f.requests[1]) { throw IllegalArgumentException("listener boom") }
            check("a throwing listener's exception propagates", false) { "did not throw" }
        } catch (e: IllegalArgumentException) {
            check("a throwing listener's exception propagates", e.message == "listener boom")
        }
        // The stopped turn is not part of the conversation.
        check("usable after a throwing listener", calls(conversation.send(f.requests[1])) == f.expected(1))
    }
}

/** cancel() from another thread while the answer is being decoded. */
private fun cancellation(f: EngineFixture, engine: Engine) {
    engine.createConversation(config(f)).use { conversation ->
        val firstPiece = CountDownLatch(1)
        val cancelled = CountDownLatch(1)
        val canceller = Thread {
            firstPiece.await()
            conversation.cancel()
            cancelled.countDown()
        }.apply { start() }
        var pieces = 0
        val reply = conversation.send(f.requests[0]) {
            if (pieces++ == 0) {
                firstPiece.countDown()
                cancelled.await()
            }
        }
        canceller.join()
        check("cancel: the reply says cancelled", reply.cancelled && reply.finish == Finish.CANCELLED) { "$reply" }
        check("cancel: no piece after the cancel", pieces == 1) { "$pieces" }
        check("cancel: no call from a cut answer", reply.toolCalls.isEmpty()) { "$reply" }
        // Dropped from the conversation: the next send is answered as a first turn.
        check("cancel: conversation usable", calls(conversation.send(f.requests[0])) == f.expected(0))
    }
    // A cancel with no send running changes nothing.
    engine.createConversation(config(f)).use { conversation ->
        conversation.cancel()
        check("cancel while idle: next send answers", calls(conversation.send(f.requests[1])) == f.expected(1))
    }
}

/** One model, two conversations: one catalog prefill, turns kept apart, calls from two threads. */
private fun twoConversations(f: EngineFixture, engine: Engine) {
    val a = engine.createConversation(config(f))
    val b = engine.createConversation(config(f))
    check("second conversation reuses the catalog", b.catalogSource == CatalogSource.MEMORY) { "${b.catalogSource}" }
    // Interleaved turns: each conversation answers from its own turns (equal histories, equal answers).
    val a0 = a.send(f.requests[0])
    check("conversation a turn 0", calls(a0) == f.expected(0))
    check("conversation b turn 0", calls(b.send(f.requests[0])) == f.expected(0))
    val a1 = a.send(f.requests[1])
    val b1 = b.send(f.requests[1])
    check("second turns agree and call", calls(a1) == calls(b1) && a1.toolCalls.size == 1) { "${calls(a1)} / ${calls(b1)}" }
    check("a second turn feeds the first turn too", a1.requestTokens > a0.requestTokens + a0.tokens) { "$a0 / $a1" }
    val results = arrayOfNulls<String>(2)
    val threads = listOf(a, b).mapIndexed { i, c -> Thread { results[i] = calls(c.send(f.requests[2])) }.apply { start() } }
    threads.forEach { it.join() }
    check("two threads, two conversations, one model", results[0] == results[1] && results[0]!!.isNotEmpty()) { results.toList().toString() }
    // One send at a time per conversation.
    val inside = CountDownLatch(1)
    val release = CountDownLatch(1)
    val busy = Thread { a.send(f.requests[0]) { inside.countDown(); release.await() } }.apply { start() }
    inside.await()
    throwsKind("a second send on an answering conversation", "busy") { a.send(f.requests[1]) }
    release.countDown()
    busy.join()
    a.close()
    b.close()
}

private fun misuse(f: EngineFixture, engine: Engine, filesDir: File) {
    throwsKind("a missing export", "model") { Engine.open(File(filesDir, "nothing").path) }
    throwsKind("tools that are no catalog", "bad_argument") { engine.createConversation(config(f).copy(toolsJson = "{\"name\": 3}")) }
    throwsKind("a tool choice that is no tool", "bad_argument", "open_door") { engine.createConversation(config(f).copy(toolChoice = "open_door")) }
    throwsKind("sampling without top-k results", "bad_argument", "top-k") {
        engine.createConversation(config(f).copy(sampling = SamplingOptions(temperature = 0.7f, seed = 3)))
    }
    throwsKind("bad sampling settings", "bad_argument", "top_p") {
        engine.createConversation(config(f).copy(sampling = SamplingOptions(topP = 0f)))
    }
    throwsKind("a negative token budget", "bad_argument") { engine.createConversation(config(f).copy(maxNewTokens = -1)) }
    // A fresh engine: one that holds this catalog already does not read the file.
    Engine.open(f.dir).use { fresh ->
        throwsKind("a catalog file of another model", "catalog", "another model") {
            fresh.createConversation(config(f, f["engine.otherModelCatalog"]))
        }
        check("an engine usable after a refused catalog file", calls(fresh.createConversation(config(f)).use { it.send(f.requests[0]) }) == f.expected(0))
    }
    val saved = File(filesDir, "smart-home.skvsnap").path
    engine.createConversation(config(f)).use { it.saveCatalog(saved) }
    throwsKind("a catalog file of another system prompt", "catalog", "another system prompt") {
        engine.createConversation(config(f, saved).copy(systemPrompt = "You are a pirate."))
    }
    check("a catalog file of this catalog loads", engine.createConversation(config(f, saved)).use { it.catalogSource } == CatalogSource.MEMORY)
    Engine.open(f["engine.v1Dir"]).use { v1 ->
        throwsKind("constrained tools on a contract 1 export", "bad_argument", "contract 2") { v1.createConversation(config(f)) }
        val free = v1.createConversation(config(f).copy(constrained = false, maxNewTokens = 8)).use { it.send(f.requests[0]) }
        check("unconstrained on a contract 1 export answers", free.tokens in 1..8) { "$free" }
    }
    throwsKind("bad handle 0", "bad_handle") { Conversation.nativeSend(0L, "hi", null) }
    throwsKind("a never issued handle", "bad_handle") { Conversation.nativeCancel(0x5_0000_0000_0000L or 0xffffffL) }
    throwsKind("a handle of the wrong kind", "bad_handle", "kind `Conversation`") { Engine.nativeInfo(0x5_0000_0000_0001L) }
    engine.createConversation(config(f)).use { conversation ->
        throwsKind("an empty message", "bad_argument") { conversation.send("  ") }
        throwsKind("a message beyond the context", "context_full") { conversation.send("kitchen ".repeat(engine.maxPositions)) }
        check("usable after refused sends", calls(conversation.send(f.requests[0])) == f.expected(0))
    }
}

/** A device profile around one answer: the same reply, a profile bundle on disk; a bad path refused. */
private fun deviceProfile(f: EngineFixture, engine: Engine, filesDir: File) {
    engine.endDeviceProfile()
    check("ending a device profile never begun is no error", true)
    val file = File(filesDir, "answer.ireeprof")
    engine.beginDeviceProfile(file.path)
    val reply = engine.createConversation(config(f)).use { it.send(f.requests[0]) }
    engine.endDeviceProfile()
    check("device profile: the same reply", calls(reply) == f.expected(0)) { calls(reply) }
    val bytes = if (file.isFile) file.readBytes() else ByteArray(0)
    check("device profile: IREE's profile bundle", bytes.size > 4096 && String(bytes, 0, 4, Charsets.US_ASCII) == "IRPF") { "${bytes.size} bytes" }
    throwsKind("a device profile in a missing directory", "backend", "no/such") {
        engine.beginDeviceProfile(File(filesDir, "no/such/answer.ireeprof").path)
    }
    check("usable after a refused device profile", calls(engine.createConversation(config(f)).use { it.send(f.requests[1]) }) == f.expected(1))
}

/** Closed objects refuse every call, from Kotlin and through the native handles. */
private fun closed(f: EngineFixture) {
    val engine = Engine.open(f.dir)
    val conversation = engine.createConversation(config(f))
    val other = engine.createConversation(config(f))
    conversation.close()
    conversation.close()
    throwsKind("send on a closed conversation", "closed") { conversation.send(f.requests[0]) }
    throwsKind("cancel on a closed conversation", "closed") { conversation.cancel() }
    throwsKind("saveCatalog on a closed conversation", "closed") { conversation.saveCatalog("/tmp/never") }
    engine.close()
    engine.close()
    throwsKind("createConversation on a closed engine", "closed") { engine.createConversation(config(f)) }
    throwsKind("beginDeviceProfile on a closed engine", "closed") { engine.beginDeviceProfile("/tmp/never.ireeprof") }
    throwsKind("send on a conversation of a closed engine", "closed", "engine") { other.send(f.requests[0]) }
    other.close()
}
